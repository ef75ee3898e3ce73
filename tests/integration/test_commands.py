"""regenerate / gate / cancel against real Postgres, Redis and the real broker (no workers)."""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import replace

import psycopg
import pytest

from animastor_tasks.errors import InvalidCommand, StoreUnavailable
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, lanes
from animastor_tasks.flow import layers as layers_flow
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow import status as status_flow
from tests.support import wait_for

from .helpers import advertise, make_book, queued_messages, states, use_settings


def cap_books(rt, cap: int = 4) -> None:  # type: ignore[no-untyped-def]
    """A hard cap per book and stage: the quota and the window alone are fair shares that a lone book passes."""
    stages = tuple(replace(s, book_cap=cap) for s in rt.settings.registry.stages)
    use_settings(rt, replace(rt.settings, registry=replace(rt.settings.registry, stages=stages)))


@pytest.fixture
def book(rt):  # type: ignore[no-untyped-def]
    rt.catalog.import_book(make_book("b1", chapters=2, scenes=3))
    advertise(rt, "gpu.audio", "gpu.image")
    return "b1"


def test_regenerate_creates_commands_and_dispatches_through_the_gate(rt, book) -> None:
    cap_books(rt)
    result = regenerate_flow.regenerate(rt.ports, book, ["all"])
    assert [c["stage"] for c in result["commands"]] == ["audio", "image"]
    assert all(c["status"] == "active" and len(c["targets"]) == 6 for c in result["commands"])
    found = states(rt, book)
    # The book cap (4 per stage) bounds what one pass dispatches, in reading order.
    assert sum(1 for s in found.values() if s == "generating") == 8
    assert sum(1 for s in found.values() if s == "pending") == 4
    assert queued_messages(rt, "gpu.audio") == 4 and queued_messages(rt, "gpu.image") == 4
    generating_scenes = {(c, s) for (c, s, _), st in found.items() if st == "generating"}
    assert generating_scenes == {("ch1", "s1"), ("ch1", "s2"), ("ch1", "s3"), ("ch2", "s1")}  # reading order


def test_force_set_holds_exactly_the_named_pairs(rt, book) -> None:
    regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s2"]])
    members = rt.redis.client.smembers(rt.redis.keys.force_set(book))
    assert members == {"ch1:s2:audio"}
    assert 0 < rt.redis.client.ttl(rt.redis.keys.force_set(book)) <= 120
    found = states(rt, book)
    assert [p for p, s in found.items() if s != "dirty"] == [("ch1", "s2", "audio")]


def test_resending_a_command_id_is_a_no_op(rt, book) -> None:
    cid = str(uuid.uuid4())
    first = regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]], command_id=cid)
    again = regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]], command_id=cid)
    assert first["commands"][0]["command_id"] == cid == again["commands"][0]["command_id"]
    assert again.get("replayed") is True
    assert len(rt.ports.commands.commands(book=book)) == 1
    assert queued_messages(rt, "gpu.audio") == 1


def test_a_resend_after_the_redis_writes_failed_finishes_what_the_first_sending_left(rt, book, monkeypatch) -> None:
    """Old code: the commands committed, Redis failed (the caller heard StoreUnavailable), and the resend the caller
    then made was answered from the commands alone: the pairs stayed behind their old deferrals (here a 15-minute
    one) and nothing was dispatched until those ran out."""
    from animastor_tasks.errors import StoreUnavailable

    rt.redis.client.zadd(rt.redis.keys.deferrals(book, "idempotent"), {"ch1:s1:audio": rt.ports.clock() + 900})
    real = rt.ports.book_state.start_work

    def redis_fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise StoreUnavailable("redis", "redis://127.0.0.1:6379/0", "Connection reset by peer")

    cid = str(uuid.uuid4())
    monkeypatch.setattr(rt.ports.book_state, "start_work", redis_fails)
    with pytest.raises(StoreUnavailable):
        regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]], command_id=cid)
    assert states(rt, book)[("ch1", "s1", "audio")] == "pending" and queued_messages(rt, "gpu.audio") == 0
    monkeypatch.setattr(rt.ports.book_state, "start_work", real)
    again = regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]], command_id=cid)
    assert again["replayed"] is True and [c["command_id"] for c in again["commands"]] == [cid]
    assert states(rt, book)[("ch1", "s1", "audio")] == "generating" and queued_messages(rt, "gpu.audio") == 1
    assert rt.redis.client.smembers(rt.redis.keys.force_set(book)) == {"ch1:s1:audio"}
    # Resent once more, nothing more is dispatched: the pair is generating under its command.
    regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]], command_id=cid)
    assert queued_messages(rt, "gpu.audio") == 1


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"scenes": [["ch1", "s2"]]}, "other scenes"),
        ({"scenes": [["ch1", "s1"], ["ch1", "s2"]]}, "other scenes"),
        ({"stages": ["image"]}, "other stages (first sent for audio)"),
        ({"force": False}, "other force (first sent with true)"),
        ({"priority": "interactive"}, "other priority (first sent as normal)"),
    ],
)
def test_a_command_id_resent_with_another_request_is_refused_and_changes_nothing(rt, book, change, needle) -> None:
    """The id names one request. Another request under it got the first one's commands back as a replay, and its
    own scenes, stages, force or priority were dropped without a word."""
    cid = str(uuid.uuid4())
    sent = {"stages": ["audio"], "scenes": [["ch1", "s1"]]}
    regenerate_flow.regenerate(rt.ports, book, command_id=cid, **sent)
    before = states(rt, book)
    with pytest.raises(InvalidCommand, match=rf"command_id: {cid} was first sent with {re.escape(needle)}"):
        regenerate_flow.regenerate(rt.ports, book, command_id=cid, **{**sent, **change})
    assert [c.command_id for c in rt.ports.commands.commands(book=book)] == [cid]
    assert states(rt, book) == before
    assert queued_messages(rt, "gpu.audio") == 1 and queued_messages(rt, "gpu.image") == 0


def test_a_resend_may_name_stages_whose_layer_made_no_command(rt, book) -> None:
    layers_flow.set_layers(rt.ports, book, [], ["image"])
    cid = str(uuid.uuid4())
    first = regenerate_flow.regenerate(rt.ports, book, ["all"], command_id=cid)
    assert [c["stage"] for c in first["commands"]] == ["audio"]
    again = regenerate_flow.regenerate(rt.ports, book, ["audio", "image"], command_id=cid)
    assert again["replayed"] is True and [c["command_id"] for c in again["commands"]] == [cid]
    # The answer a retry gets is the first one's, its skipped stages included (it used to say none was skipped).
    assert again["skipped"] == first["skipped"] == [{"stage": "image", "reason": "layer_disabled"}]


EVERY_SCENE = [[f"ch{c}", f"s{n}"] for c in (1, 2) for n in (1, 2, 3)]  # the `book` fixture's


@pytest.mark.parametrize(
    ("first", "again", "needle"),
    [
        ({"stages": ["audio"]}, {"stages": ["audio", "image"]}, "other stages (first sent for audio)"),
        ({"stages": ["all"]}, {"stages": ["audio"]}, "other stages (first sent for audio, image)"),
        ({"scenes": [["ch1", "s1"]]}, {"scenes": None}, "other scenes (first sent for named scenes)"),
        ({"scenes": None}, {"scenes": EVERY_SCENE}, "other scenes (first sent for the whole book)"),
    ],
)
def test_a_resend_must_ask_for_what_the_first_sending_asked_not_only_what_it_made(
    rt, book, first, again, needle
) -> None:
    """Image's layer is off: the first sending made an audio command whatever it asked. Old code held a resend to
    the commands alone, and a resend adding image, or asking for the whole book where the first named a scene,
    got the first sending's commands back as a replay: its own intent dropped without a word."""
    layers_flow.set_layers(rt.ports, book, [], ["image"])
    cid = str(uuid.uuid4())
    sent = {"stages": ["audio"], "scenes": [["ch1", "s1"]]}
    regenerate_flow.regenerate(rt.ports, book, command_id=cid, **{**sent, **first})
    made = rt.ports.commands.commands(book=book)
    with pytest.raises(InvalidCommand, match=rf"command_id: {cid} was first sent with {re.escape(needle)}"):
        regenerate_flow.regenerate(rt.ports, book, command_id=cid, **{**sent, **again})
    assert rt.ports.commands.commands(book=book) == made


def test_a_command_of_an_older_version_holds_a_resend_to_its_commands_only(rt, book) -> None:
    """Written before migration 0009, a command says nothing of what its request asked: a resend adding a stage, or
    asking for the whole book, replays as it always did rather than being refused on a guess."""
    layers_flow.set_layers(rt.ports, book, [], ["image"])
    cid = str(uuid.uuid4())
    regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]], command_id=cid)
    with rt.db.transaction() as conn:
        conn.execute("UPDATE commands SET requested_stages = NULL, whole_book = NULL WHERE request_id = %s", (cid,))
    again = regenerate_flow.regenerate(rt.ports, book, ["audio", "image"], None, command_id=cid)
    assert again["replayed"] is True and [c["command_id"] for c in again["commands"]] == [cid]
    with pytest.raises(InvalidCommand, match="other stages"):  # still held to the commands it made
        regenerate_flow.regenerate(rt.ports, book, ["image"], None, command_id=cid)


def test_a_command_id_that_names_a_command_of_another_request_is_refused(rt, book) -> None:
    """A request of two stages names its commands uuid5(request, stage). Sent again as a request's own id (a
    service that kept a command's id from the reply), it found no request of that id, failed on the command's
    key and answered an empty replay: nothing done, and no error said so."""
    request = str(uuid.uuid4())
    created = regenerate_flow.regenerate(rt.ports, book, ["all"], command_id=request)["commands"]
    audio = next(c["command_id"] for c in created if c["stage"] == "audio")
    assert audio == str(uuid.uuid5(uuid.UUID(request), "audio"))
    with pytest.raises(InvalidCommand, match="already the id of a command"):
        regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]], command_id=audio)
    assert len(rt.ports.commands.commands(book=book)) == 2


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"book_id": "nope", "stages": ["audio"]}, "unknown book"),
        ({"book_id": "b1", "stages": ["video"]}, "unknown stage 'video'"),
        ({"book_id": "b1", "stages": "audio"}, "stages"),
        ({"book_id": "b1", "stages": []}, "stages"),
        ({"book_id": "b1", "stages": ["audio"], "scenes": [["ch9", "s1"]]}, "not in book"),
        ({"book_id": "b1", "stages": ["audio"], "scenes": [["ch1"]]}, "scenes[0]"),
        ({"book_id": "b1", "stages": ["audio"], "scenes": [["ch1", "s\n1"]]}, "U+000A"),
        ({"book_id": 42, "stages": ["audio"]}, "book_id"),
        ({"book_id": "b1", "stages": ["audio"], "command_id": "not-a-uuid"}, "command_id"),
        ({"book_id": "b1", "stages": ["audio"], "force": "yes"}, "force"),
        # Spellings `uuid.UUID` reads but the contract's schema refuses: each was stored as another string.
        ({"book_id": "b1", "stages": ["audio"], "command_id": "{12345678-1234-5678-1234-567812345678}"}, "command_id"),
        ({"book_id": "b1", "stages": ["audio"], "command_id": "urn:uuid:12345678-1234-5678-1234-567812345678"}, "UUID"),
        ({"book_id": "b1", "stages": ["audio"], "command_id": "12345678123456781234567812345678"}, "command_id"),
        ({"book_id": "b1", "stages": ["audio"], "command_id": "1-2345678123456781234567812345678"}, "command_id"),
    ],
)
def test_bad_calls_are_refused_and_write_nothing(rt, book, kwargs, needle) -> None:
    with pytest.raises(InvalidCommand) as info:
        regenerate_flow.regenerate(rt.ports, **kwargs)
    assert needle in str(info.value)
    assert rt.ports.commands.commands(book=book) == []
    assert set(states(rt, book).values()) == {"dirty"}
    assert queued_messages(rt, "gpu.audio") == 0


def test_disabled_layer_is_skipped_and_reported(rt, book) -> None:
    layers_flow.set_layers(rt.ports, book, [], ["image"])
    result = regenerate_flow.regenerate(rt.ports, book, ["all"])
    assert [c["stage"] for c in result["commands"]] == ["audio"]
    assert result["skipped"] == [{"stage": "image", "reason": "layer_disabled"}]
    assert layers_flow.layers_of(rt.ports, book) == {"audio": True, "image": False}


def test_a_layer_change_saved_while_redis_cannot_be_reached_is_answered_as_done(rt, book, monkeypatch) -> None:
    """The change was in Postgres (which every pass and job start reads), then Redis failed its mirror: reported
    as failed (exit 3), a change in force read as lost. Its pending pairs are released with it, in Postgres; its
    pass (the book's active scenes and due time in Redis) waits for the next one."""
    import redis

    regenerate_flow.regenerate(rt.ports, book, ["image"])
    monkeypatch.setattr(rt.redis, "client", redis.Redis(port=1, socket_connect_timeout=0.2))  # Redis down
    assert layers_flow.set_layers(rt.ports, book, [], ["image"]) == {"audio": True, "image": False}
    monkeypatch.undo()
    assert layers_flow.layers_of(rt.ports, book) == {"audio": True, "image": False}
    assert {s for (_, _, st), s in states(rt, book).items() if st == "image"} <= {"dirty", "generating"}
    gate.gate_pass(rt.ports, book)  # the next pass
    assert {s for (_, _, st), s in states(rt, book).items() if st == "image"} <= {"dirty", "generating"}


def test_disabling_a_layer_releases_its_pending_pairs(rt, book, caplog) -> None:
    """And says so in the log: released in the change's transaction (869382d), the pairs no longer went through the
    pass that logged them, and a layer change left no trace of what it had stopped."""
    rt.presence.heartbeat("test-worker@local", (), 1, gone=["gpu.image"])  # no image consumer...
    advertise(rt, "gpu.audio")
    cap_books(rt)
    regenerate_flow.regenerate(rt.ports, book, ["audio"])
    pending = list(states(rt, book).values()).count("pending")
    assert pending
    with caplog.at_level(logging.INFO, logger="animastor.commands"):
        layers_flow.set_layers(rt.ports, book, [], ["audio"])
    found = states(rt, book)
    assert "pending" not in found.values()  # never pending without authority
    said = [r.getMessage() for r in caplog.records if "released" in r.getMessage()]
    assert said == [f"[COMMAND] book={book!r} layers off: audio; released {pending} pending pair(s) to dirty"], said


def test_cancel_is_final_until_a_new_regenerate(rt, book) -> None:
    regenerate_flow.regenerate(rt.ports, book, ["all"])
    out = cancel_flow.cancel(rt.ports, book, "reader pressed stop")
    assert out["released"] == 12 and len(out["cancelled_commands"]) == 2
    found = states(rt, book)
    assert set(found.values()) == {"dirty"}
    assert rt.redis.client.exists(rt.redis.keys.cancel_flag(book)) == 1
    assert rt.ports.commands.is_tombstoned(book)
    assert rt.redis.client.exists(rt.redis.keys.force_set(book), rt.redis.keys.active_scenes(book)) == 0
    assert book not in rt.ports.book_state.active_books()
    assert {c.status for c in rt.ports.commands.commands(book=book)} == {"cancelled"}
    # No pair is authorized afterwards, whatever a gate pass sees.
    report = gate.gate_pass(rt.ports, book)
    assert report.authorized == [] and report.dispatched == []
    assert cancel_flow.cancel(rt.ports, book)["released"] == 0  # idempotent
    # A new regenerate lifts the cancel.
    regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]])
    assert not rt.ports.commands.is_tombstoned(book) and not rt.ports.book_state.cancel_flag_set(book)
    assert states(rt, book)[("ch1", "s1", "audio")] == "generating"


@pytest.mark.parametrize("step", ["release_leases", "next_waiters"])
def test_a_stop_all_whose_redis_cleanup_fails_after_its_commit_is_still_reported_done(
    rt, book, step, monkeypatch
) -> None:
    """The tombstone, the commands and the pairs committed, then a Redis blip failed the leases' drop or the
    hand-over of the freed slots: Stop All was reported failed (exit 3 for the CLI, an error for the caller)
    although it had taken effect, and its answer (what it cancelled and released) was lost. The flag, set first,
    stops the jobs."""
    cap_books(rt, 1)
    regenerate_flow.regenerate(rt.ports, book, ["audio"])

    def blip(*args: object, **kwargs: object) -> None:
        raise StoreUnavailable("redis", rt.settings.redis_url, "connection reset")

    store = rt.ports.leases if step == "release_leases" else rt.ports.deferrals
    monkeypatch.setattr(store, step, blip)
    out = cancel_flow.cancel(rt.ports, book, "reader pressed stop")
    assert out["released"] == 6 and len(out["cancelled_commands"]) == 1
    assert rt.ports.commands.is_tombstoned(book) and rt.ports.book_state.cancel_flag_set(book)
    assert set(states(rt, book).values()) == {"dirty"}


@pytest.mark.parametrize("reason", ["stop\x00now", "stop \udc80", 42, "x" * 1_001])
def test_a_cancel_reason_postgres_cannot_store_is_refused_before_anything_is_written(rt, book, reason) -> None:
    """A NUL or a lone surrogate failed the cancel in Postgres after the Redis flag was set and the book's Redis
    state wiped: no tombstone, the commands still active, a half-done Stop All the same reason could not finish.
    A reason of any length was copied onto every command it ended (1,000 characters at most now)."""
    regenerate_flow.regenerate(rt.ports, book, ["audio"])
    before = states(rt, book)
    with pytest.raises(InvalidCommand, match="reason"):
        cancel_flow.cancel(rt.ports, book, reason)
    assert not rt.ports.book_state.cancel_flag_set(book) and not rt.ports.commands.is_tombstoned(book)
    assert states(rt, book) == before and book in rt.ports.book_state.active_books()
    assert {c.status for c in rt.ports.commands.commands(book=book)} == {"active"}


def test_a_stop_all_of_an_unknown_book_sent_again_lifts_the_flag_its_outage_left(rt, monkeypatch) -> None:
    """A Stop All that met a Postgres outage sets its flag without knowing whether the book exists, and its caller is
    told to send it again. Of a book Postgres does not hold (a typo), the resend was refused as unknown and the flag
    stayed for good: a book imported later under that id read as cancelled, with no command. The refusal lifts it;
    a mirror of a tombstone, or another book's flag, is not touched."""
    books = rt.ports.catalog

    def down(book: str) -> bool:
        raise StoreUnavailable("postgres", "postgresql://db", "connection refused")

    monkeypatch.setattr(books, "book_exists", down)
    with pytest.raises(StoreUnavailable):
        cancel_flow.cancel(rt.ports, "typo-book")
    assert rt.ports.book_state.cancel_flag_set("typo-book")
    monkeypatch.undo()
    with pytest.raises(InvalidCommand, match="unknown book 'typo-book'"):
        cancel_flow.cancel(rt.ports, "typo-book")  # the resend, Postgres back
    assert not rt.ports.book_state.cancel_flag_set("typo-book")
    rt.catalog.import_book(make_book("typo-book", chapters=1, scenes=1))
    assert status_flow.status(rt.ports, "typo-book")["cancelled"] is False
    rt.ports.book_state.set_cancel_flags(["mirrored"])  # a tombstone's mirror: only a Stop All's own flag goes
    with pytest.raises(InvalidCommand):
        cancel_flow.cancel(rt.ports, "mirrored")
    assert rt.ports.book_state.cancel_flag_set("mirrored")


def test_a_stop_all_between_a_regenerates_lift_and_its_commands_leaves_the_new_command_to_run(rt, book) -> None:
    """A Stop All that set the cancel flag after the regenerate lifted it, and committed before the regenerate's
    commands did: the new command was active, the book flagged, and the regenerate's own pass released its
    pairs (cancelled, said the flag) with nothing marked, so the command stayed active for ever."""
    lift = rt.ports.book_state.lift_cancel_flag

    def lift_then_stop_all(book_id: str, request: str, now: float) -> bool:
        lifted = lift(book_id, request, now)
        cancel_flow.cancel(rt.ports, book_id, "pressed stop")
        return lifted

    rt.ports.book_state.lift_cancel_flag = lift_then_stop_all  # type: ignore[method-assign]
    [created] = regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]])["commands"]
    rt.ports.book_state.lift_cancel_flag = lift  # type: ignore[method-assign]
    assert not rt.ports.book_state.cancel_flag_set(book) and not rt.ports.commands.is_tombstoned(book)
    assert states(rt, book)[("ch1", "s1", "audio")] == "generating"
    assert created["status"] == "active"


def _regenerate_after(rt, book: str, step: str, monkeypatch) -> list[str | None]:  # type: ignore[no-untyped-def]
    """`step` of the commands store wrapped: a regenerate of ch1/s1 comes in wholly after it commits, before its
    caller's Redis clean-up. What held the pair's lease just before that regenerate (and then just after)."""
    real = getattr(rt.ports.commands, step)
    seen: list[str | None] = []

    def then_regenerate(*args: object) -> object:
        out = real(*args)
        seen.extend(rt.ports.leases.lease_holders([(book, "ch1", "s1", "audio")]))
        regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]])
        seen.extend(rt.ports.leases.lease_holders([(book, "ch1", "s1", "audio")]))
        return out

    monkeypatch.setattr(rt.ports.commands, step, then_regenerate)
    return seen


def test_a_stop_all_leaves_the_lease_of_a_claim_made_after_its_commit(rt, book, monkeypatch) -> None:
    """Stop All dropped the released jobs' leases by pair, whoever held them: a regenerate whose claim came
    between its commit and that drop lost its lease: its slot counted as free, and its job was refused at its start."""
    regenerate_flow.regenerate(rt.ports, book, ["audio"])
    seen = _regenerate_after(rt, book, "cancel_book", monkeypatch)
    assert cancel_flow.cancel(rt.ports, book)["revoked"] >= 1
    before, claimed = seen
    assert claimed is not None and claimed != before
    assert rt.ports.leases.lease_holders([(book, "ch1", "s1", "audio")]) == [claimed]


def test_a_blocked_stage_leaves_the_lease_of_a_claim_made_after_its_commit(rt, book, monkeypatch) -> None:
    """As Stop All: a stage BLOCKED (no live consumer) dropped its released pairs' leases by pair."""
    regenerate_flow.regenerate(rt.ports, book, ["audio"])
    seen = _regenerate_after(rt, book, "block_stage", monkeypatch)
    lanes.block_stage(rt.ports, book, rt.settings.registry.get("audio"))
    before, claimed = seen
    assert claimed is not None and claimed != before
    assert rt.ports.leases.lease_holders([(book, "ch1", "s1", "audio")]) == [claimed]


def test_cancel_of_one_book_never_touches_another(rt) -> None:
    for b in ("a*", "abc", "a"):
        rt.catalog.import_book(make_book(b))
    advertise(rt, "gpu.audio", "gpu.image")
    for b in ("a*", "abc", "a"):
        regenerate_flow.regenerate(rt.ports, b, ["audio"])
    cancel_flow.cancel(rt.ports, "a*")
    assert set(states(rt, "a*").values()) == {"dirty"}
    for other in ("abc", "a"):
        audio = {st for (_, _, stage), st in states(rt, other).items() if stage == "audio"}
        assert audio <= {"pending", "generating"} and audio  # still in flight (lane: 4 + 4 of 8 taken)
        assert not rt.ports.book_state.cancel_flag_set(other)
        assert other in rt.ports.book_state.active_books()


def test_status_json_shape(rt, book) -> None:
    regenerate_flow.regenerate(rt.ports, book, ["audio"])
    data = status_flow.status(rt.ports, book)
    assert set(data) == {"book_id", "cancelled", "commands", "scenes"}
    command = data["commands"][0]
    assert set(command["progress"]) == {
        "total",
        "dirty",
        "pending",
        "generating",
        "ready",
        "failed",
        "released",
        "released_reasons",
    }
    assert command["progress"]["total"] == 6
    assert command["progress"]["released"] == 0 and command["progress"]["released_reasons"] == {}
    assert data["scenes"][0]["stages"]["audio"]["state"] in {"pending", "generating"}
    cell = {"state": "dirty", "artifact": None, "artifact_uri": None, "error": None}
    assert data["scenes"][0]["stages"]["image"] == cell


def test_gate_with_postgres_unreachable_authorizes_nothing_and_recovers(rt, book) -> None:
    """A registry that cannot be read proves no command: the pass fails closed, the process survives."""
    from animastor_tasks.adapters.postgres.assets import AssetStore
    from animastor_tasks.adapters.postgres.pool import Database

    regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]])
    rt.ports.book_state.activate({book: [("ch2", "s1")]})
    unreachable = Database("postgresql://postgres@127.0.0.1:1/none", timeout=1)
    try:
        report = gate.gate_pass(replace(rt.ports, assets=AssetStore(unreachable)), book)
        assert report.error and "postgres unavailable" in report.error
        assert report.authorized == [] and report.dispatched == []
    finally:
        unreachable.close()
    assert gate.gate_pass(rt.ports, book).error is None


def test_reconcile_leaves_the_flag_of_a_book_a_regenerate_took_back_from_stop_all_lifted(rt, book, monkeypatch) -> None:
    """Reconcile sets the cancel flag of every tombstoned book (Redis may have lost it). A regenerate that deleted
    the tombstone and lifted the flag between reconcile's read and its write had the flag set again: every job of
    the new command was refused at its start and every pass released its pairs, the command active for ever."""
    cancel_flow.cancel(rt.ports, book)
    read_tombstones = rt.ports.commands.tombstoned_books
    calls: list[int] = []

    def read_then_a_regenerate() -> list[str]:
        stale = read_tombstones()
        if not calls:
            calls.append(1)
            regenerate_flow.regenerate(rt.ports, book, ["audio"])
        return stale

    monkeypatch.setattr(rt.ports.commands, "tombstoned_books", read_then_a_regenerate)
    reconcile_flow.reconcile(rt.ports, force=True)
    assert not rt.ports.book_state.cancel_flag_set(book)
    assert "generating" in states(rt, book).values()


def test_a_scene_removed_by_an_import_between_the_checks_and_the_writes_is_a_clear_error(rt, book) -> None:
    """The regenerate checks its scenes, then writes its commands: a re-import that removed a named scene in
    between made the write fail with a raw driver error (a traceback, exit 1 at the CLI) instead of InvalidCommand."""
    from dataclasses import replace as replace_book

    checked = rt.catalog.command_context

    def checked_then_removed(*args: object) -> object:
        context = checked(*args)
        full = make_book("b1", chapters=2, scenes=3)
        first, *rest = full.chapters
        rt.catalog.import_book(replace_book(full, chapters=[replace_book(first, scenes=first.scenes[1:]), *rest]))
        return context

    rt.catalog.command_context = checked_then_removed  # type: ignore[method-assign]
    try:
        with pytest.raises(InvalidCommand, match="removed"):
            regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]])
    finally:
        del rt.catalog.command_context
    assert rt.ports.commands.commands(book=book) == []


def test_a_whole_book_regenerate_targets_the_scenes_there_as_it_writes(rt, book) -> None:
    """A whole-book command targeted the scene list read before the book's lock: an import that removed a scene in
    between made the write fail with InvalidCommand "a scene named was removed" (none was named; a client does not
    resend on InvalidCommand, though a resend would pass). Its targets are the book's scenes under the lock now: the
    removed one is none of them, one added meanwhile is one."""
    from animastor_tasks.domain.book import book_to_dict, parse_book

    checked = rt.catalog.command_context
    doc = book_to_dict(make_book("b1", chapters=2, scenes=3))
    scenes = doc["chapters"][0]["scenes"]
    scenes[0] = {**scenes[0], "scene_id": "s4"}  # s1 removed, s4 added

    def checked_then_edited(*args: object) -> object:
        context = checked(*args)
        rt.catalog.import_book(parse_book(doc))
        return context

    rt.catalog.command_context = checked_then_edited  # type: ignore[method-assign]
    try:
        [made] = regenerate_flow.regenerate(rt.ports, book, ["audio"])["commands"]
    finally:
        del rt.catalog.command_context
    now = {("ch1", "s4"), ("ch1", "s2"), ("ch1", "s3"), ("ch2", "s1"), ("ch2", "s2"), ("ch2", "s3")}
    assert {tuple(t) for t in made["targets"]} == now
    [command] = rt.ports.commands.commands(command_ids=[made["command_id"]])
    assert command.targets == 6 and command.status == "active"
    audio = {(c, s): state for (c, s, stage), state in states(rt, book).items() if stage == "audio"}
    assert set(audio) == now and "dirty" not in audio.values()
    assert rt.ports.book_state.active_scene_count(book) == 6


def test_a_regenerate_answers_once_its_commands_are_on_disk(rt, book, monkeypatch) -> None:
    """The commands commit without waiting for their WAL flush (the first job is published a flush sooner); the
    regenerate's last read waits for it, so no answer says a command is there that a database crash could lose."""
    unflushed: list[int] = []
    create = rt.ports.commands.create_commands

    def created_then_seen(*args, **kwargs):  # type: ignore[no-untyped-def]
        made = create(*args, **kwargs)
        with rt.db.read() as conn:  # how far the WAL is written now, the commands' commit included
            unflushed.append(int(conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'").fetchone()[0]))
        return made

    monkeypatch.setattr(rt.ports.commands, "create_commands", created_then_seen)
    regenerate_flow.regenerate(rt.ports, "b1", ["audio"], [["ch1", "s1"]])
    with rt.db.read() as conn:
        flushed = int(conn.execute("SELECT pg_current_wal_flush_lsn() - '0/0'").fetchone()[0])
    assert unflushed and flushed >= unflushed[0]


def test_a_resend_answers_once_the_commands_it_replays_are_on_disk(rt, book) -> None:
    """A resend that came while the first sending's commands were not yet flushed (they commit without waiting)
    must not answer for them before they are on disk, as the first sending's own answer does not."""
    first = regenerate_flow.regenerate(rt.ports, "b1", ["audio"], [["ch1", "s1"]])
    command_id = first["commands"][0]["command_id"]
    with rt.db.transaction() as conn:  # a write whose commit does not wait for its flush, as the commands' did
        conn.execute("SET LOCAL synchronous_commit = off")
        conn.execute("UPDATE books SET title = title WHERE book_id = 'b1'")
    with rt.db.read() as conn:
        written = int(conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'").fetchone()[0])
    again = regenerate_flow.regenerate(rt.ports, "b1", ["audio"], [["ch1", "s1"]], command_id=command_id)
    with rt.db.read() as conn:
        flushed = int(conn.execute("SELECT pg_current_wal_flush_lsn() - '0/0'").fetchone()[0])
    assert again["replayed"] and flushed >= written


def test_a_layer_change_from_a_shell_with_another_stage_table_keeps_the_layers_it_does_not_know(rt, book) -> None:
    """The config was rebuilt from the shell's own stages and written over: `--enable audio` from a shell without
    the image stage dropped `image_enabled: false`, and the next `regenerate all` commanded image jobs again."""
    layers_flow.set_layers(rt.ports, book, [], ["image"])
    full = rt.settings
    audio_only = tuple(s for s in full.registry.stages if s.name == "audio")
    use_settings(rt, replace(full, registry=replace(full.registry, stages=audio_only)))
    assert layers_flow.set_layers(rt.ports, book, ["audio"], []) == {"audio": True}
    use_settings(rt, full)
    assert layers_flow.layers_of(rt.ports, book) == {"audio": True, "image": False}
    assert [c["stage"] for c in regenerate_flow.regenerate(rt.ports, book, ["all"])["commands"]] == ["audio"]


def test_two_layer_changes_at_once_both_hold(rt, book) -> None:
    """Each read the config, then wrote its own whole: the second undid the first (both callers told done)."""
    import threading

    holder = psycopg.connect(rt.settings.database_url)
    holder.execute("SELECT 1 FROM books WHERE book_id = %s FOR UPDATE", (book,))  # both changes queue behind it
    done: list[object] = []

    def change(disable: str) -> None:
        try:
            done.append(layers_flow.set_layers(rt.ports, book, [], [disable]))
        except BaseException as err:  # asserted below
            done.append(err)

    threads = [threading.Thread(target=change, args=(stage,)) for stage in ("audio", "image")]
    try:
        for thread in threads:
            thread.start()
        with psycopg.connect(rt.settings.database_url, autocommit=True) as watch:
            wait_for(
                lambda: (
                    watch.execute(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                    ).fetchone()[0]
                    >= 2
                ),
                10,
                "both changes wait for the book's row",
            )
    finally:
        holder.commit()
        holder.close()
        for thread in threads:
            thread.join(30)
    assert all(isinstance(d, dict) for d in done), done
    assert layers_flow.layers_of(rt.ports, book) == {"audio": False, "image": False}


def test_a_regenerate_refused_after_a_stop_all_leaves_the_cancel_flag_set(rt, book) -> None:
    """The flag was lifted before the commands were made, and stayed lifted when they were refused: a running job,
    which stops on the flag (all that stops it when its Stop All could not reach it), ran on to its end."""
    request = str(uuid.uuid4())
    regenerate_flow.regenerate(rt.ports, book, ["all"], command_id=request)
    cancel_flow.cancel(rt.ports, book)
    assert rt.ports.book_state.cancel_flag_set(book)
    taken = str(uuid.uuid5(uuid.UUID(request), "audio"))  # the id of one of the first request's commands
    with pytest.raises(InvalidCommand, match="already the id of a command of another request"):
        regenerate_flow.regenerate(rt.ports, book, ["audio"], command_id=taken)
    assert rt.ports.book_state.cancel_flag_set(book)
    # A regenerate that is taken lifts it, as before.
    regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert not rt.ports.book_state.cancel_flag_set(book)


def test_reading_a_requests_statuses_waits_for_no_second_command_and_so_for_no_deadlock(rt, book) -> None:
    """The read was an update of every command of the request, locking them in key order: a transaction holding one
    of them and then wanting another (a Stop All, a settle: their own order) deadlocked with it, and Postgres failed
    a side. It holds one now, and waits for no other."""
    import threading

    first = regenerate_flow.regenerate(rt.ports, book, ["all"], [["ch1", "s1"]])["commands"]
    ids = sorted(c["command_id"] for c in first)
    holder = psycopg.connect(rt.settings.database_url)
    read: list[object] = []
    try:
        holder.execute("UPDATE commands SET updated_at = now() WHERE command_id = %s", (ids[1],))
        reading = threading.Thread(target=lambda: read.append(rt.ports.commands.command_statuses(ids)))
        reading.start()
        reading.join(5)
        assert not reading.is_alive(), "the read waits for a command another transaction holds"
        holder.execute("UPDATE commands SET updated_at = now() WHERE command_id = %s", (ids[0],))
        holder.commit()
    finally:
        holder.close()
    assert read == [{cid: "active" for cid in ids}]


def test_a_request_made_twice_at_once_logs_no_aborted_pipeline(rt, book, caplog) -> None:
    """Two deliveries of one request checked it unused at once, and the second's insert met the first's key: its
    DuplicateCommand (a replay, as it should be) came with psycopg's WARNING "error ignored terminating
    <psycopg.Pipeline [INERROR]>: pipeline aborted", 62 times in a hunt's run, read as an error by operators."""
    from animastor_tasks.errors import DuplicateCommand

    request = str(uuid.uuid4())
    per_stage = {"audio": (request, [("ch1", "s1")])}
    rt.ports.commands.create_commands("b1", request, per_stage, True)
    with caplog.at_level(logging.DEBUG), pytest.raises(DuplicateCommand):
        rt.ports.commands.create_commands("b1", request, per_stage, True)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_stage_blocked_again_with_nothing_left_to_block_asks_the_operator_for_nothing(rt, book, caplog) -> None:
    """The tick passed a book whose stage was BLOCKED a moment before: a second BLOCKED warning, `commands=none
    released=0`, told the operator to start a worker and send a new regenerate, though nothing had changed."""
    regenerate_flow.regenerate(rt.ports, book, ["audio"])
    spec = rt.settings.registry.get("audio")
    with caplog.at_level(logging.INFO, logger="animastor.dispatch"):
        assert lanes.block_stage(rt.ports, book, spec)
        assert lanes.block_stage(rt.ports, book, spec) == []
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "BLOCKED" in warned[0] and "released=0" not in warned[0]


def _commands_of(rt, book: str) -> int:  # type: ignore[no-untyped-def]
    with rt.db.read() as conn:
        return int(conn.execute("SELECT count(*) FROM commands WHERE book_id = %s", (book,)).fetchone()[0])


def test_a_regenerate_sent_before_a_stop_all_that_was_taken_first_is_void(rt, book) -> None:
    """A Stop All goes ahead of normal and bulk regenerates in the control queue: one sent after a regenerate of its
    book could be taken first, and the regenerate, taken after it, ran though the Stop All was meant to stop it."""
    now = rt.ports.clock()
    cancel_flow.cancel(rt.ports, book, sent_at=now - 1)
    void = regenerate_flow.regenerate(rt.ports, book, ["audio", "image"], sent_at=now - 2)
    assert void == {
        "commands": [],
        "skipped": [{"stage": "audio", "reason": "stopped"}, {"stage": "image", "reason": "stopped"}],
    }
    assert _commands_of(rt, book) == 0
    after = regenerate_flow.regenerate(rt.ports, book, ["audio"], sent_at=now)
    assert [c["status"] for c in after["commands"]] == ["active"]
    unstamped = regenerate_flow.regenerate(rt.ports, book, ["image"])  # a hand-made message: no stamp, taken as sent
    assert [c["status"] for c in unstamped["commands"]] == ["active"]


def test_a_resend_of_a_void_regenerate_is_void_too(rt, book) -> None:
    """The client's timeout says to resend with the same command id: the resend, sent after the Stop All, made the
    work the Stop All had stopped (review)."""
    now = rt.ports.clock()
    cancel_flow.cancel(rt.ports, book, sent_at=now - 1)
    request = str(uuid.uuid4())
    assert regenerate_flow.regenerate(rt.ports, book, ["audio"], command_id=request, sent_at=now - 2)["commands"] == []
    again = regenerate_flow.regenerate(rt.ports, book, ["audio"], command_id=request, sent_at=now + 1)
    assert again == {"commands": [], "skipped": [{"stage": "audio", "reason": "stopped"}]}
    assert _commands_of(rt, book) == 0


def test_a_stop_all_sent_without_a_stamp_counts_as_sent_when_it_is_taken(rt, book) -> None:
    """Sent by hand or from Flower (no stamp, at the control queue's first priority), it overtook a client's
    regenerate sent before it, which then ran (review)."""
    before = rt.ports.clock() - 0.5
    cancel_flow.cancel(rt.ports, book)
    assert regenerate_flow.regenerate(rt.ports, book, ["audio"], sent_at=before)["commands"] == []


def test_a_stamp_that_cannot_be_true_is_not_believed(rt, book) -> None:
    """One in milliseconds (a hand-made sender's) voided every later regenerate of its book for good (review)."""
    now = rt.ports.clock()
    cancel_flow.cancel(rt.ports, book, sent_at=now * 1000)  # counted as sent when taken
    assert regenerate_flow.regenerate(rt.ports, book, ["audio"], sent_at=now + 1)["commands"]


def test_a_later_stop_all_of_another_book_voids_nothing(rt, book) -> None:
    rt.catalog.import_book(make_book("other"))
    now = rt.ports.clock()
    cancel_flow.cancel(rt.ports, "other", sent_at=now)
    assert regenerate_flow.regenerate(rt.ports, book, ["audio"], sent_at=now - 1)["commands"]
