"""Commands always settle: a target released to `dirty` while its command is active (layer turned
off, stage BLOCKED, a dead lease without authority) ends its command with a reason and a count."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest

from animastor_tasks.adapters.postgres.settle import settle_commands
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, refill
from animastor_tasks.flow import layers as layers_flow
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow import status as status_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, lose_leases, make_book, queued_messages, states
from .test_cli_reads import cli
from .test_generate import dispatched_jobs, with_stage


@pytest.fixture
def book(rt, tmp_path):  # type: ignore[no-untyped-def]
    # A hard cap of 4 keeps two of the six scenes pending (the quota alone is a fair share now).
    with_stage(rt, replace(rt.settings.registry.get("audio"), book_cap=4), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=2, scenes=3))
    advertise(rt, "gpu.audio")
    return "b"


def command(rt: Wiring, book: str, command_id: str) -> dict:
    [found] = [c for c in status_flow.status(rt.ports, book)["commands"] if c["command_id"] == command_id]
    return found


def test_disabling_a_layer_settles_the_command_with_its_released_targets(rt, book, monkeypatch) -> None:
    cid = regenerate_flow.regenerate(rt.ports, book, ["audio"])["commands"][0]["command_id"]
    # The finished jobs' slots are not refilled (as if the control worker were slow): two pairs stay pending.
    monkeypatch.setattr(refill, "free_slot", lambda *args, **kwargs: None)
    for job in dispatched_jobs(rt, book):  # the book cap (4) let four of six go
        assert run_job(rt.ports, job, worker="test")["outcome"] == "ready"
    assert list(states(rt, book).values()).count("pending") == 2
    layers_flow.set_layers(rt.ports, book, [], ["audio"])
    found = command(rt, book, cid)
    assert found["status"] == "failed"
    assert found["reason"] == "2 of 6 targets released (layer_disabled)"
    assert found["progress"]["ready"] == 4 and found["progress"]["dirty"] == 2
    assert found["progress"]["released"] == 2
    assert found["progress"]["released_reasons"] == {"layer_disabled": 2}
    # Turning the layer back on re-authorizes nothing: only a new command brings the work back.
    layers_flow.set_layers(rt.ports, book, ["audio"], [])
    assert gate.gate_pass(rt.ports, book).dispatched == []
    assert list(states(rt, book).values()).count("dirty") == 8  # 2 audio + 6 image


def test_a_blocked_stage_reports_its_released_targets(rt, book) -> None:
    rt.redis.client.delete(rt.redis.keys.consumers("gpu.audio"))  # no audio consumer, none just stopped either
    cid = regenerate_flow.regenerate(rt.ports, book, ["audio"])["commands"][0]["command_id"]
    found = command(rt, book, cid)
    assert found["status"] == "blocked" and found["reason"] == "no_worker:audio"
    assert found["progress"]["released"] == 6
    assert found["progress"]["released_reasons"] == {"no_worker:audio": 6}


def test_reconcile_of_an_unauthorized_dead_lease_settles_the_command(rt, book) -> None:
    cid = regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]])["commands"][0]["command_id"]
    assert states(rt, book)[("ch1", "s1", "audio")] == "generating"
    layers_flow.set_layers(rt.ports, book, [], ["audio"])  # a generating pair is left to its job...
    assert command(rt, book, cid)["status"] == "active"
    rt.redis.client.delete("gpu.audio")  # ...whose worker took it and died with it
    lose_leases(rt, [(book, "ch1", "s1", "audio")])
    assert reconcile_flow.reconcile(rt.ports, force=True)["expired"] == 1
    found = command(rt, book, cid)
    assert states(rt, book)[("ch1", "s1", "audio")] == "dirty"
    assert (found["status"], found["reason"]) == ("failed", "1 of 1 targets released (layer_disabled)")
    assert found["progress"]["released_reasons"] == {"layer_disabled": 1}


def test_a_release_by_the_cancel_flag_is_left_to_cancel(rt, book) -> None:
    """Stop All sets the Redis flag first: a gate pass in between denies the pairs and releases the pending ones
    (the flag alone stops the book: its Postgres half may fail), marking nothing on their targets (the facts in
    Postgres do not explain the release: the Stop All's own step ends the commands), and the command ends
    `cancelled` (by cancel), never `failed`."""
    cid = regenerate_flow.regenerate(rt.ports, book, ["audio"])["commands"][0]["command_id"]
    pending = {p for p, s in states(rt, book).items() if s == "pending"}
    rt.ports.book_state.stop_book(book)
    report = gate.gate_pass(rt.ports, book)
    assert set(report.released) == pending and report.dispatched == [] and set(report.denied.values()) == {"cancelled"}
    found = command(rt, book, cid)
    assert found["status"] == "active" and found["progress"]["released"] == 0
    cancel_flow.cancel(rt.ports, book)
    assert command(rt, book, cid)["status"] == "cancelled"


def test_commands_json_carries_the_released_counts(rt, book) -> None:
    regenerate_flow.regenerate(rt.ports, book, ["audio"])
    layers_flow.set_layers(rt.ports, book, [], ["audio"])
    [row] = json.loads(cli("commands", book, "--json").stdout)
    assert row["status"] == "active"  # four targets are still generating
    assert row["progress"]["released"] == 2 and row["progress"]["released_reasons"] == {"layer_disabled": 2}


def test_a_command_settles_beside_another_command_s_pairs_in_flight(rt, book) -> None:
    # The settle looks only at commands none of whose own targets is in flight: the image command's
    # pending pairs must not hold the audio command back, and its own in-flight pairs must hold it.
    advertise(rt, "gpu.image")
    audio = regenerate_flow.regenerate(rt.ports, book, ["audio"])["commands"][0]["command_id"]
    image = regenerate_flow.regenerate(rt.ports, book, ["image"])["commands"][0]["command_id"]
    with rt.db.transaction() as conn:
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = %s AND stage = 'audio'", (book,))
        conn.execute("UPDATE asset_states SET state = 'pending' WHERE book_id = %s AND stage = 'image'", (book,))
        assert settle_commands(conn, book) == [audio]
    assert command(rt, book, audio)["status"] == "completed"
    assert command(rt, book, image)["status"] == "active"


def regenerate_while_a_commit_is_open(rt: Wiring, book: str, force: bool) -> tuple[str, str]:
    """s1's job commits, held open between its settle and its COMMIT, while a regenerate of s1 comes in.
    (The regenerate's command id, the dispatch id of the job that committed.)"""
    regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]])
    pair = ("ch1", "s1", "audio")
    [first] = [job.dispatch_id for job in dispatched_jobs(rt, book)]
    with rt.db.transaction() as conn:
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('book:' || %s))", (book,))
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('lane:gpu.audio'))")
        conn.execute(
            "UPDATE asset_states a SET state = 'ready', artifact_sha256 = %s, input_hash = s.input_hashes ->> a.stage"
            " FROM scenes s WHERE a.book_id = %s AND a.chapter_id = 'ch1' AND a.scene_id = 's1'"
            " AND a.stage = 'audio' AND s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
            " AND s.scene_id = a.scene_id",
            ("0" * 64, book),
        )
        settle_commands(conn, book, pair)
        answer: dict = {}
        later = threading.Thread(
            target=lambda: answer.update(
                regenerate_flow.regenerate(rt.ports, book, ["audio"], [["ch1", "s1"]], force=force)
            )
        )
        later.start()
        later.join(0.5)
        assert later.is_alive(), "the command came in while the commit was open"
    later.join(10)
    [created] = answer["commands"]
    return created["command_id"], first


def test_a_command_created_while_its_targets_job_commits_still_settles(rt, book) -> None:
    """Without force: the commit's settle ran before the command existed, and the command saw the pair
    `generating` (left to the running job), so nothing ever settled it (it stayed active, its target ready).
    The command now waits for the book's lock, which the commit holds, and finds the pair `ready`."""
    cid, _ = regenerate_while_a_commit_is_open(rt, book, force=False)
    assert command(rt, book, cid)["status"] == "completed"  # settled as already completed
    assert states(rt, book)[("ch1", "s1", "audio")] == "ready"


def test_a_forced_command_created_while_its_targets_job_commits_runs_the_scene_again(rt, book) -> None:
    """With force: the command's fencing update waited for the commit's row, then skipped it (`ready` now), so
    the forced run was lost and the command stayed active. Now the pair goes back to `pending` and runs again."""
    cid, first = regenerate_while_a_commit_is_open(rt, book, force=True)
    assert states(rt, book)[("ch1", "s1", "audio")] == "generating"
    assert [job.dispatch_id for job in dispatched_jobs(rt, book)] != [first]
    assert command(rt, book, cid)["status"] == "active"


def test_a_queued_job_refused_for_its_layer_off_stays_released_when_the_layer_is_turned_on_again(rt, book) -> None:
    """Refused at its start, the job gave its pair back `pending` for the book's pass to release; the layer turned
    on again before that pass (within a tick), the pass ran the pair with no new regenerate (a hunt: 6 image jobs
    started after a layer toggled off and on 1 s apart)."""
    cid = regenerate_flow.regenerate(rt.ports, book, ["audio"])["commands"][0]["command_id"]
    queued = dispatched_jobs(rt, book)
    assert len(queued) == 4  # the cap: two of six wait
    layers_flow.set_layers(rt.ports, book, [], ["audio"])  # releases the two pending; the four queued wait to start
    for job in queued:
        assert run_job(rt.ports, job, worker="test")["reason"] == "layer_disabled"
    layers_flow.set_layers(rt.ports, book, ["audio"], [])
    assert gate.gate_pass(rt.ports, book).dispatched == []
    assert [s for (_, _, st), s in states(rt, book).items() if st == "audio"] == ["dirty"] * 6
    found = command(rt, book, cid)
    assert found["status"] == "failed" and found["reason"] == "6 of 6 targets released (layer_disabled)", found


def test_a_layer_turned_off_between_a_pass_s_decision_and_its_claim_dispatches_nothing_of_it(rt, book, monkeypatch):
    """The change committed after the regenerate's pass authorized the audio pairs and before it claimed them; the
    change's own pass came later. The claim's compare-and-set on `pending` took them all the same: four jobs
    published to gpu.audio under `{"audio_enabled": false}`, holding lane slots until a worker refused them.
    The change now releases the stage's pending pairs under the book's lock the claim takes."""
    real = rt.ports.assets.claiming
    fired: list[bool] = []

    def claiming(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not fired:
            fired.append(True)
            assert rt.ports.catalog.change_layers(book, {"audio": False}) is not None  # committed here
        return real(*args, **kwargs)

    monkeypatch.setattr(rt.ports.assets, "claiming", claiming)
    cid = regenerate_flow.regenerate(rt.ports, book, ["audio"])["commands"][0]["command_id"]
    assert fired
    assert queued_messages(rt, "gpu.audio") == 0
    assert {s for (_, _, st), s in states(rt, book).items() if st == "audio"} == {"dirty"}
    found = command(rt, book, cid)
    assert (found["status"], found["reason"]) == ("failed", "6 of 6 targets released (layer_disabled)")
    assert rt.ports.assets.lane_load(["audio"]).get("audio", 0) == 0
