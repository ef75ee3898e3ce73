"""The elastic share: `book_quota` and `window` bind only while another book waits for the lane,
`book_cap` always; a finishing book queues again at its own priority.

Real Postgres, Redis and broker: jobs run in-process through `run_job` (the builtin generator),
and the control messages they send (gate passes, hand-overs) are taken off the real broker queue
and run through the real Celery tasks, oldest first, as the control worker would.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import redis

from animastor_tasks.domain.deferral import wait_score
from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.errors import InvalidCommand, StoreUnavailable
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, lanes
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.flow.job import Job
from animastor_tasks.worker import tasks
from animastor_tasks.worker.app import app
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, states, use_settings


def lane(rt: Wiring, **limits: Any) -> Wiring:
    """One audio stage with these limits and instant builtin jobs, a live consumer on its queue."""
    spec = replace(rt.settings.registry.get("audio"), params={"steps": 1, "step_seconds": 0}, **limits)
    use_settings(rt, replace(rt.settings, registry=replace(rt.settings.registry, stages=(spec,))))
    advertise(rt, "gpu.audio")
    return rt


def run_control(rt: Wiring, *, newest_first: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """Run the control messages waiting in the broker, oldest first (or newest first: the order a second control
    process may run them in), through the real tasks."""
    client = redis.Redis.from_url(rt.settings.broker_url)
    take = client.lpop if newest_first else client.rpop
    ran: list[tuple[str, dict[str, Any]]] = []
    try:
        while (raw := take(CONTROL_QUEUE)) is not None:
            message = json.loads(raw)
            _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            name = message["headers"]["task"]
            app.tasks[name].run(**kwargs)
            ran.append((name, kwargs))
    finally:
        client.close()
    return ran


def running(rt: Wiring, *books: str) -> Counter[str]:
    return Counter(b for b in books for state in states(rt, b).values() if state == "generating")


def finish_one(rt: Wiring, book: str) -> dict[str, Any]:
    """The first running job of `book` (reading order) runs to its end; then the control work it sent."""
    with rt.db.transaction() as conn:
        c, s, st, dispatch_id, token = conn.execute(
            "SELECT a.chapter_id, a.scene_id, a.stage, a.dispatch_id, a.fencing_token FROM asset_states a"
            " JOIN scenes sc USING (book_id, chapter_id, scene_id)"
            " WHERE a.book_id = %s AND a.state = 'generating' ORDER BY sc.position LIMIT 1",
            (book,),
        ).fetchone()
    result = run_job(rt.ports, Job(book, c, s, st, dispatch_id, token), worker="test@local")
    assert result["outcome"] == "ready", result
    run_control(rt)
    return result


def hand_over_while_postgres_fails_over(rt: Wiring, monkeypatch: pytest.MonkeyPatch, *, exclude: str) -> None:
    """A free audio slot handed on (not to `exclude`) while every refill's read of its book fails."""

    def failing_over(*args: object, **kwargs: object) -> None:
        raise StoreUnavailable("postgres", rt.settings.database_url, "the server is shutting down")

    with monkeypatch.context() as failover:
        failover.setattr(rt.ports.assets, "gate_candidates", failing_over)
        lanes.hand_over(rt.ports, "gpu.audio", 1, exclude=exclude)
        run_control(rt)


def waiting(rt: Wiring, queue: str = "gpu.audio") -> dict[str, float]:
    return dict(rt.redis.client.zrange(rt.redis.keys.lane_waiters(queue), 0, -1, withscores=True))


def test_a_lone_book_uses_every_free_slot_in_reading_order(rt) -> None:
    lane(rt, lane_limit=8, book_quota=4, window=4)
    rt.catalog.import_book(make_book("alone", chapters=1, scenes=12))
    regenerate_flow.regenerate(rt.ports, "alone", ["audio"])
    found = states(rt, "alone")
    assert [s for (_, s, _), state in found.items() if state == "generating"] == [f"s{i}" for i in range(1, 9)]
    # Nobody else waits: neither the quota (4) nor the window (4 scenes) held it back; the lane did.
    deferred = rt.redis.client.zrange(rt.redis.keys.deferrals("alone", "capacity"), 0, -1)
    assert sorted(deferred) == sorted(f"ch1:s{i}:audio" for i in range(9, 13))
    assert "alone" in waiting(rt)  # it waits for the lane like anyone refused by it


def test_a_lone_book_gives_its_extra_slots_back_as_its_jobs_end_and_keeps_its_share(rt) -> None:
    lane(rt, lane_limit=4, book_quota=2, window=2)
    for book in ("first", "late"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=10))
    regenerate_flow.regenerate(rt.ports, "first", ["audio"])
    assert running(rt, "first", "late") == {"first": 4}
    regenerate_flow.regenerate(rt.ports, "late", ["audio"])
    assert running(rt, "first", "late") == {"first": 4}  # nothing is preempted
    history = []
    for _ in range(6):
        finish_one(rt, "first")
        history.append(running(rt, "first", "late"))
    # Each job of `first` that ends hands its slot to `late` until both hold their share (2 each);
    # from then on `first` refills its own share and `late` takes no slot beyond its own.
    assert history[0] == {"first": 3, "late": 1}
    assert history[1] == {"first": 2, "late": 2}
    assert all(h == {"first": 2, "late": 2} for h in history[2:]), history


def test_a_waiting_book_already_at_its_share_does_not_hold_a_slot_back(rt) -> None:
    """Work conservation: a slot no waiting book may take under the fair share goes to a book that can."""
    lane(rt, lane_limit=5, book_quota=2, window=2)
    for book in ("a", "b"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=6))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert running(rt, "a", "b") == {"a": 5}
    finish_one(rt, "a")
    finish_one(rt, "a")
    finish_one(rt, "a")
    # Both hold their share (2) and the fifth slot is not held back for either: no slot left idle.
    now = running(rt, "a", "b")
    assert sum(now.values()) == 5 and min(now["a"], now["b"]) == 2, now


def test_book_cap_is_a_hard_cap_even_alone(rt) -> None:
    lane(rt, lane_limit=8, book_quota=4, window=4, book_cap=3)
    for book in ("capped", "other"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=6))
    regenerate_flow.regenerate(rt.ports, "capped", ["audio"])
    assert running(rt, "capped") == {"capped": 3}
    deferred = rt.redis.client.zrange(rt.redis.keys.deferrals("capped", "capacity"), 0, -1)
    assert len(deferred) == 3  # quota_exhausted: the pairs still say why they wait
    assert "capped" not in waiting(rt)  # more free slots would not help it: it does not wait for the lane
    regenerate_flow.regenerate(rt.ports, "other", ["audio"])
    assert running(rt, "capped", "other") == {"capped": 3, "other": 3}  # other is capped too
    finish_one(rt, "capped")
    assert running(rt, "capped", "other")["capped"] == 3  # its own freed room goes to it at once


@pytest.mark.parametrize("priority", ["interactive", "bulk"])
def test_a_finishing_book_queues_again_at_the_priority_of_its_job_or_keeps_a_slot_it_outranks(
    rt, priority: str
) -> None:
    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book in ("runner", "waiter"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "runner", ["audio"], priority=priority)
    regenerate_flow.regenerate(rt.ports, "waiter", ["audio"])
    rt.redis.client.zrem(rt.redis.keys.lane_waiters("gpu.audio"), "runner")  # as if it had just been handed
    finish_one(rt, "runner")
    if priority == "bulk":  # the normal waiter is more urgent: the slot is its turn
        assert running(rt, "runner", "waiter") == {"waiter": 1}
        assert int(waiting(rt)["runner"] // 1e10) == 2
    else:  # the runner's next scene is more urgent than the waiter: it keeps the slot; the waiter waits on
        assert running(rt, "runner", "waiter") == {"runner": 1}
        assert "waiter" in waiting(rt)


def test_the_gate_task_contract_is_unchanged_and_a_batch_passes_each_book(rt) -> None:
    lane(rt, lane_limit=8)
    for book in ("x", "y"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert tasks.gate_task.run("x")["book_id"] == "x"
    assert tasks.gate_batch.run(["x", "y"]) == 2


def test_a_reader_s_next_interactive_scene_takes_the_slot_its_last_one_freed_before_bulk_waiters(rt) -> None:
    lane(rt, lane_limit=1, book_quota=10, window=10)
    for book in ("reader", "bulk"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], [["ch1", "s1"]], priority="interactive")
    regenerate_flow.regenerate(rt.ports, "bulk", ["audio"], priority="bulk")  # waits for the lane
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], [["ch1", "s2"]], priority="interactive")
    finish_one(rt, "reader")
    assert states(rt, "reader")[("ch1", "s2", "audio")] == "generating"
    assert running(rt, "reader", "bulk") == {"reader": 1} and "bulk" in waiting(rt)
    finish_one(rt, "reader")  # nothing more of the reader's: the slot goes on to the bulk book
    assert running(rt, "reader", "bulk") == {"bulk": 1}


def test_the_runtime_s_own_tasks_run_a_message_of_a_newer_version(rt, caplog) -> None:
    """A rolling deploy: a newer version's message, with a kwarg this one does not know, reaches this worker. It
    failed with a TypeError (a refill so lost left its slot idle until reconcile); it runs, the kwarg logged."""
    lane(rt, lane_limit=8)
    rt.catalog.import_book(make_book("x", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])
    later = {"added_later": 1}
    assert tasks.refill_task.run("x", lane="gpu.audio", freed=None, **later)["book_id"] == "x"
    with pytest.raises(InvalidCommand, match="unknown argument"):  # a caller's task (not the runtime's): its schema
        tasks.gate_task.run("x", **later)
    assert tasks.gate_batch.run(["x"], **later) == 1
    tasks.tick.run(**later)
    assert "round_done" in tasks.reconcile.run(**later)
    generate = tasks.app.tasks[rt.settings.registry.get("audio").task_name]
    job = generate.run(book_id="x", chapter_id="ch1", scene_id="nope", stage="audio", dispatch_id="d",
                       fencing_token=1, **later)  # fmt: skip
    assert job["outcome"] == "fence_rejected"
    assert "ignored added_later, sent by a newer version" in caplog.text


def test_a_reader_s_interactive_scene_takes_the_slot_its_own_bulk_job_freed_before_bulk_waiters(rt) -> None:
    """Old code: the book whose job ended was never taken from the list for its own slot, and only its finished
    (bulk) job's rank was weighed against the head: the other bulk book got the slot, and the reader's scene
    waited a whole job more (every slot of a lane full of the reader's own bulk jobs: the next to end elsewhere)."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    for book in ("reader", "other"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], priority="bulk")  # s1 takes the slot
    regenerate_flow.regenerate(rt.ports, "other", ["audio"], priority="bulk")  # waits for the lane
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], [["ch1", "s3"]], priority="interactive")
    assert int(waiting(rt)["reader"] // 1e10) == 0
    finish_one(rt, "reader")
    assert states(rt, "reader")[("ch1", "s3", "audio")] == "generating"
    assert running(rt, "reader", "other") == {"reader": 1}
    assert "reader" not in waiting(rt) or int(waiting(rt)["reader"] // 1e10) == 2  # only its bulk scene waits
    finish_one(rt, "reader")  # the interactive scene ends: now the other bulk book's turn
    assert running(rt, "reader", "other") == {"other": 1}


def test_a_book_whose_interactive_job_ends_does_not_keep_the_slot_for_its_bulk_scenes(rt) -> None:
    """Old code: the finished job's interactive rank outranked a normal waiter, and the book kept the slot for
    a bulk scene while the normal book waited."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    for book in ("runner", "waiter"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "runner", ["audio"], [["ch1", "s1"]], priority="interactive")
    regenerate_flow.regenerate(rt.ports, "runner", ["audio"], [["ch1", "s2"], ["ch1", "s3"]], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "waiter", ["audio"])  # normal
    finish_one(rt, "runner")
    assert running(rt, "runner", "waiter") == {"waiter": 1}


def test_a_postgres_outage_during_handed_refills_keeps_the_waiting_list(rt, monkeypatch) -> None:
    """A handed refill that could not read its book (Postgres failing over) passed the slot on: the next book's
    refill failed the same way, and so on until every waiting book was off the list, the slot finally idle, the
    books back only as their capacity deferrals ran out (a minute), in the order of their last refusal."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book in ("x", "a", "b", "c"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert running(rt, "x", "a", "b", "c") == {"x": 1}
    assert [b for b in waiting(rt) if b != "x"] == ["a", "b", "c"]
    hand_over_while_postgres_fails_over(rt, monkeypatch, exclude="x")
    assert [b for b in waiting(rt) if b != "x"] == ["a", "b", "c"]  # nobody dropped off, the order kept
    due = rt.redis.client.zscore(rt.redis.keys.due(), "a")
    assert due is not None and due <= rt.ports.clock()  # the tick passes it once Postgres answers


def test_a_book_served_alone_does_not_keep_its_interactive_place_for_its_bulk_scenes(rt) -> None:
    """With nobody else waiting, a book whose job ended kept its entry on the waiting list at the interactive rank
    its reader's scene had given it; its next refusal (a bulk scene) could not move it back down (a place only
    ever improves), so when its interactive job ended it outranked a normal waiter and ran its bulk scene first."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    for book in ("runner", "waiter"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "runner", ["audio"], [["ch1", "s1"], ["ch1", "s2"]], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "runner", ["audio"], [["ch1", "s3"]], priority="interactive")
    finish_one(rt, "runner")  # s1 ends, nobody else waits: the reader's s3 runs
    assert states(rt, "runner")[("ch1", "s3", "audio")] == "generating"
    regenerate_flow.regenerate(rt.ports, "waiter", ["audio"], [["ch1", "s1"]])  # normal
    finish_one(rt, "runner")  # s3 ends: a normal waiter goes before runner's bulk s2
    assert running(rt, "runner", "waiter") == {"waiter": 1}


def test_slots_freed_together_go_one_to_each_book_waiting(rt) -> None:
    """A Stop All (or a takeover) frees several slots at once and hands one to each waiting book. Each book's refill
    took every free slot it could, since the others, handed a slot too, were off the waiting list and its fair share
    no longer bound: the first refill took them all, and the other books waited a whole job for theirs."""
    from animastor_tasks.flow import cancel as cancel_flow

    lane(rt, lane_limit=2, book_quota=4, window=4)
    for book, scenes in (("stopped", 2), ("a", 3), ("b", 3)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "stopped", ["audio"])
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert running(rt, "stopped", "a", "b") == {"stopped": 2} and set(waiting(rt)) == {"a", "b"}
    cancel_flow.cancel(rt.ports, "stopped")
    run_control(rt)
    assert running(rt, "stopped", "a", "b") == {"a": 1, "b": 1}


def test_a_book_handed_several_slots_it_has_no_use_for_passes_them_all_on(rt) -> None:
    from animastor_tasks.domain.deferral import wait_score
    from animastor_tasks.flow import refill

    lane(rt, lane_limit=4)
    rt.catalog.import_book(make_book("idle", chapters=1, scenes=1))  # nothing of it commanded
    for i, book in enumerate(("x", "y")):
        rt.ports.deferrals.wait_for_lane("gpu.audio", book, wait_score(1, 100.0 + i))
    refill.refill(rt.ports, "idle", "gpu.audio", slots_of="gpu.audio", slots=2)
    assert waiting(rt) == {}  # both slots went on, one to each waiting book (one did, and y waited a job)
    assert sorted(kwargs["book_id"] for _, kwargs in run_control(rt)) == ["x", "y"]


def test_a_share_one_book_had_no_use_for_goes_to_the_book_that_has_more_to_run(rt) -> None:
    """Of slots freed together, the head book's share was more than it had pairs for: it passed the rest to a
    waiting list the other book was not back on yet (off it since it was handed its share), and that book, with
    more pairs than its share, waited beside the free slot. The last refill of the hand-over hands it on."""
    from animastor_tasks.flow import cancel as cancel_flow

    lane(rt, lane_limit=3, book_quota=4, window=4)
    for book, scenes in (("stopped", 3), ("a", 1), ("b", 5)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    for book in ("stopped", "a", "b"):
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert running(rt, "stopped", "a", "b") == {"stopped": 3} and list(waiting(rt)) == ["a", "b"]
    cancel_flow.cancel(rt.ports, "stopped")  # a is handed 2 slots, b 1; a's refill runs first
    run_control(rt)
    assert running(rt, "stopped", "a", "b") == {"a": 1, "b": 2}
    assert not rt.redis.client.keys(rt.redis.keys.handing("*"))  # the hand-over's count went with its last refill


def test_a_reader_s_interactive_scene_is_not_held_to_its_book_s_share_by_a_bulk_book_waiting(rt) -> None:
    """Old code: any book below its share waiting made the share bind whatever its priority: the reader's scene
    was refused (`quota_exhausted`) and the slot the reader's own job freed went to the bulk book."""
    lane(rt, lane_limit=2, book_quota=1, window=10)
    for book in ("reader", "library"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=4))
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], priority="bulk")  # alone: both slots
    regenerate_flow.regenerate(rt.ports, "library", ["audio"], priority="bulk")  # waits for the lane
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], [["ch1", "s4"]], priority="interactive")
    assert running(rt, "reader", "library") == {"reader": 2}
    finish_one(rt, "reader")
    assert states(rt, "reader")[("ch1", "s4", "audio")] == "generating"
    assert running(rt, "reader", "library") == {"reader": 2}


def test_a_book_handed_a_slot_its_own_share_refuses_waits_behind_the_books_that_waited_longer(rt) -> None:
    """Old code: a handed book that claimed nothing went back to the head of its priority whatever had refused it,
    as if another pass had taken the slot first: refused by its own share, it went ahead of `d`, which had waited
    longer with nothing running, and took the next free slot from it."""
    lane(rt, lane_limit=2, book_quota=1, window=10)
    for book in ("a", "w", "d"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])  # alone: both slots, s3 waits for the lane
    # `a` waits as of now, at the head: as when a job of its ended unseen (a served place gives way then).
    rt.ports.deferrals.wait_for_lane("gpu.audio", "a", wait_score(1, rt.ports.clock()))
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])  # waits
    regenerate_flow.regenerate(rt.ports, "d", ["audio"])  # waits
    with rt.db.transaction() as conn:  # one of a's jobs ends: a slot is free, `a` is at its share
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'a' AND scene_id = 's1'")
    assert lanes.hand_over(rt.ports, "gpu.audio", 1) == ["a"]  # the head of the list
    run_control(rt)
    assert running(rt, "a", "w", "d") == {"a": 1, "w": 1}  # `a` had no use for it within its share: w's
    assert list(waiting(rt)) == ["d", "a", "w"]  # w waits on for its own next scene


def test_stop_all_takes_the_book_off_the_lanes_waiting_lists(rt) -> None:
    """Old code: the cancelled book kept its place (here a reader's, interactive) with nothing left to run, and the
    books after it were held to their shares for it until a hand-over served it and it passed the slot on."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book in ("x", "reader", "w"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], [["ch1", "s1"]], priority="interactive")
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])
    assert list(waiting(rt)) == ["reader", "w", "x"]  # x, whose job runs, behind the books that came meanwhile
    cancel_flow.cancel(rt.ports, "reader")
    assert "reader" not in waiting(rt) and "w" in waiting(rt)


def test_a_book_whose_own_pass_ran_its_reader_s_scene_waits_on_at_its_bulk_scenes_rank(rt) -> None:
    """Old code: a pass of the book itself (the tick's, not a hand-over) ran the reader's interactive scene in a
    slot it found free, and the book kept the interactive place that scene had given it on the waiting list (a
    place only ever improved), so the next free slot went to its bulk scene ahead of a normal waiter."""
    lane(rt, lane_limit=2, book_quota=10, window=10)
    for book, scenes in (("x", 1), ("y", 1), ("reader", 3), ("w", 1)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])
    regenerate_flow.regenerate(rt.ports, "y", ["audio"])  # the lane is full
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], [["ch1", "s2"], ["ch1", "s3"]], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], [["ch1", "s1"]], priority="interactive")
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])  # normal
    assert list(waiting(rt)) == ["reader", "w"]
    with rt.db.transaction() as conn:  # x's job ends with no refill (its process died after the commit)
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'x'")
    reader_pairs = [("ch1", s, "audio") for s in ("s1", "s2", "s3")]
    rt.ports.deferrals.clear_deferrals("reader", reader_pairs)  # as when their capacity deferrals run out
    gate.gate_pass(rt.ports, "reader")  # the tick's pass of the book, due then, finds the slot free
    assert states(rt, "reader")[("ch1", "s1", "audio")] == "generating"
    assert list(waiting(rt)) == ["w", "reader"]  # served: behind the normal waiter, at its bulk scenes' rank
    finish_one(rt, "y")  # a slot frees: the normal waiter's, not the reader's bulk scene
    assert running(rt, "reader", "w") == {"reader": 1, "w": 1}


def test_slots_handed_one_at_a_time_go_one_to_each_book_handed_one(rt, monkeypatch) -> None:
    """Two job ends moments apart each hand their slot to the next book waiting. A hand-over to one book sent its
    refill no count of slots: the first refill to run claimed both free slots (the other book, handed one, binds no
    share), and the other book's refill found the lane full: it ran nothing for a whole job (a hunt: 2 s jobs, quota
    1, one book running 2 while the other ran 0 with 5 pending)."""
    from animastor_tasks.flow import refill

    lane(rt, lane_limit=2, book_quota=1, window=2)
    for book, scenes in (("first", 2), ("c", 4), ("s", 4)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    for book in ("first", "c", "s"):
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert running(rt, "first", "c", "s") == {"first": 2} and list(waiting(rt)) == ["c", "s"]
    with monkeypatch.context() as m:  # both jobs end; their slots are handed one at a time, below
        m.setattr(refill, "free_slot", lambda *_a, **_k: None)
        finish_one(rt, "first")
        finish_one(rt, "first")
    assert lanes.hand_over(rt.ports, "gpu.audio", 1) == ["c"]
    assert lanes.hand_over(rt.ports, "gpu.audio", 1) == ["s"]
    run_control(rt)  # c's refill first
    assert running(rt, "first", "c", "s") == {"c": 1, "s": 1}
