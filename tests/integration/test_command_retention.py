"""Ended and BLOCKED commands past the retention are pruned by reconcile with their targets, a slice at a time; nothing
else is. The event journal is kept by age and by row count. Real Postgres and Redis."""

from __future__ import annotations

import uuid
from dataclasses import replace

from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, use_settings


def regenerate_scene(rt: Wiring, scene: str, command_id: str | None = None) -> str:
    found = regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", scene]], command_id=command_id)
    return str(found["commands"][0]["command_id"])


def age(rt: Wiring, command_id: str, status: str, days: float) -> None:
    with rt.db.transaction() as conn:
        conn.execute(
            "UPDATE commands SET status = %s, updated_at = now() - make_interval(secs => %s) WHERE command_id = %s",
            (status, days * 86400, command_id),
        )


def kept(rt: Wiring) -> tuple[set[str], set[str]]:
    """The commands still there, and those with targets still there."""
    with rt.db.read() as conn:
        commands = {str(r[0]) for r in conn.execute("SELECT command_id FROM commands WHERE book_id = 'b'")}
        targeted = {str(r[0]) for r in conn.execute("SELECT command_id FROM command_targets WHERE book_id = 'b'")}
    return commands, targeted


def test_only_commands_that_ended_before_the_retention_go_with_their_targets(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, "gpu.audio")
    ids = {
        name: regenerate_scene(rt, f"s{n}")
        for n, name in enumerate(["completed", "failed", "cancelled", "blocked", "active", "recent"], start=1)
    }
    for status in ("completed", "failed", "cancelled", "blocked", "active"):
        age(rt, ids[status], status, days=10)
    age(rt, ids["recent"], "completed", days=2)
    assert rt.ports.commands.prune_commands(7, 50_000) == 4  # a BLOCKED command is over too: never retried
    commands, targeted = kept(rt)
    assert commands == targeted == {ids["active"], ids["recent"]}
    assert rt.ports.commands.prune_commands(7, 50_000) == 0


def test_a_pass_prunes_the_oldest_commands_as_many_targets_as_its_budget_holds(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=10))
    advertise(rt, "gpu.audio")
    whole = [str(regenerate_flow.regenerate(rt.ports, "b", ["audio"])["commands"][0]["command_id"]) for _ in range(3)]
    for days, command_id in zip((30, 20, 10), whole, strict=True):
        age(rt, command_id, "completed", days)
    assert rt.ports.commands.prune_commands(7, 5) == 1  # one command at least, however many targets it has
    assert kept(rt)[0] == set(whole[1:])
    assert rt.ports.commands.prune_commands(7, 20) == 2  # 10 + 10 targets
    assert kept(rt) == (set(), set())


def test_a_resend_of_a_pruned_command_id_makes_new_commands(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    request = str(uuid.uuid4())
    first = regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s1"]], command_id=request)
    assert regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s1"]], command_id=request)["replayed"]
    age(rt, first["commands"][0]["command_id"], "completed", days=10)
    assert rt.ports.commands.prune_commands(7, 50_000) == 1
    again = regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s1"]], command_id=request)
    assert "replayed" not in again and again["commands"][0]["status"] == "active"


def test_reconcile_prunes_ended_commands_only_when_a_retention_is_set(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    old = regenerate_scene(rt, "s1")
    age(rt, old, "completed", days=400)
    report = reconcile_flow.reconcile(rt.ports, force=True)
    assert report["pruned_commands"] == 0 and kept(rt)[0] == {old}  # the default: kept for ever
    use_settings(rt, replace(rt.settings, command_retention_days=30))
    report = reconcile_flow.reconcile(rt.ports, force=True)
    assert report["pruned_commands"] == 1 and kept(rt) == (set(), set())


def events(rt: Wiring) -> int:
    with rt.db.read() as conn:
        return int(conn.execute("SELECT count(*) FROM events WHERE book_id = 'b'").fetchone()[0])


def test_the_journal_keeps_events_by_age_and_by_count_and_zero_days_is_no_age_limit(rt) -> None:
    """`ANIMASTOR_JOURNAL_RETENTION_DAYS=0` (which, for commands, means kept for ever) emptied the whole journal
    on every reconcile; the journal's pruning had no test at all."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, "gpu.audio")
    for scene in ("s1", "s2", "s3"):
        regenerate_scene(rt, scene)
    journal = rt.ports.journal
    written = events(rt)
    assert written >= 3
    with rt.db.transaction() as conn:
        conn.execute("UPDATE events SET at = now() - interval '3 days' WHERE id = (SELECT min(id) FROM events)")
    assert journal.prune_journal(0, 1_000_000) == 0 and events(rt) == written  # no age limit
    assert journal.prune_journal(2, 1_000_000) == 1 and events(rt) == written - 1  # older than 2 days
    assert journal.prune_journal(0, 2) >= written - 3 and events(rt) <= 2  # the newest rows only
    use_settings(rt, replace(rt.settings, journal_retention_days=0.0))
    before = events(rt)
    reconcile_flow.reconcile(rt.ports, force=True)
    assert events(rt) >= before


def test_a_request_is_pruned_whole_once_its_every_command_is_past_the_retention(rt) -> None:
    """Commands went one by one: with its audio command pruned and its image one kept, a resend of the request got
    the image command back and was told the audio layer was off (`skipped: layer_disabled`), nothing redone."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    advertise(rt, "gpu.image")
    request = str(uuid.uuid4())
    first = regenerate_flow.regenerate(rt.ports, "b", ["audio", "image"], [["ch1", "s1"]], command_id=request)
    by_stage = {c["stage"]: c["command_id"] for c in first["commands"]}
    age(rt, by_stage["audio"], "completed", days=10)
    assert rt.ports.commands.prune_commands(7, 50_000) == 0  # its image command is still at work
    again = regenerate_flow.regenerate(rt.ports, "b", ["audio", "image"], [["ch1", "s1"]], command_id=request)
    assert again["replayed"] and again["skipped"] == [], again
    assert {c["command_id"] for c in again["commands"]} == set(by_stage.values())
    age(rt, by_stage["image"], "completed", days=8)
    assert rt.ports.commands.prune_commands(7, 1) == 2  # both, though the budget held one target
    assert kept(rt) == (set(), set())
