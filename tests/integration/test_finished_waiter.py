"""A book whose job ends with nothing left pending for the lane neither keeps the slot nor waits for the lane again
(lua/lane_take.lua, told by the job's commit what its book has left). *Why:* queued again at its job's priority, a
finished book was handed the next freed slot, found nothing, and passed it on through the control queue: the slot
idled for a control hop at almost every hand-off of a farm of one-scene readers, and the stale entry bound every
later book's fair share meanwhile."""

from __future__ import annotations

from dataclasses import replace

from animastor_tasks.domain.deferral import RANK_SCALE, wait_score
from animastor_tasks.flow import refill
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.flow.job import Job
from animastor_tasks.records import Committed
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, use_settings
from .test_elastic_share import finish_one, lane, run_control, running, waiting


def end_here(rt: Wiring, book: str) -> None:
    """The running job of `book` runs to its end in its GPU process; the control work it sends is not run."""
    with rt.db.transaction() as conn:
        row = conn.execute(
            "SELECT chapter_id, scene_id, stage, dispatch_id, fencing_token FROM asset_states"
            " WHERE book_id = %s AND state = 'generating' LIMIT 1",
            (book,),
        ).fetchone()
    assert row is not None
    c, s, st, d, t = row
    assert run_job(rt.ports, Job(book, c, s, st, d, t), worker="test@local")["outcome"] == "ready"


def test_a_readers_last_job_leaves_no_place_behind_and_the_next_reader_starts_in_the_freeing_process(
    rt: Wiring,
) -> None:
    lane(rt, lane_limit=1, book_quota=10, window=10)
    rt.catalog.import_book(make_book("bulk", chapters=1, scenes=3))
    for r in ("r1", "r2", "r3"):
        rt.catalog.import_book(make_book(r, chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "bulk", ["audio"], priority="bulk")  # takes the only slot
    regenerate_flow.regenerate(rt.ports, "r1", ["audio"], priority="interactive")
    finish_one(rt, "bulk")  # -> r1 runs
    regenerate_flow.regenerate(rt.ports, "r2", ["audio"], priority="interactive")
    finish_one(rt, "r1")  # r1's only job ends -> r2 runs
    assert running(rt, "bulk", "r1", "r2") == {"r2": 1}
    assert rt.ports.commands.commands(book="r1")[0].status == "completed"
    assert "r1" not in waiting(rt)  # nothing pending: no place kept
    assert waiting(rt)["bulk"] >= 2 * RANK_SCALE  # the bulk book still waits, at its own priority
    regenerate_flow.regenerate(rt.ports, "r3", ["audio"], priority="interactive")
    end_here(rt, "r2")
    assert running(rt, "bulk", "r1", "r2", "r3") == {"r3": 1}  # refilled where r2's job ended, no control hop
    assert "r2" not in waiting(rt)


def test_a_stream_of_one_scene_readers_hands_every_slot_on_in_the_freeing_process(rt: Wiring) -> None:
    lane(rt, lane_limit=1, book_quota=10, window=10)
    readers = [f"r{i}" for i in range(1, 8)]
    for r in readers:
        rt.catalog.import_book(make_book(r, chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "r1", ["audio"], priority="interactive")  # takes the slot
    regenerate_flow.regenerate(rt.ports, "r2", ["audio"], priority="interactive")
    idle = []
    for i in range(1, 6):
        regenerate_flow.regenerate(rt.ports, readers[i + 1], ["audio"], priority="interactive")
        end_here(rt, readers[i - 1])
        idle.append(sum(running(rt, *readers).values()) == 0)
        run_control(rt)
    assert idle == [False] * 5
    assert set(waiting(rt)) == {"r7"}  # only the reader whose scene still waits


def test_a_readers_last_job_does_not_keep_the_slot_for_nothing(rt: Wiring) -> None:
    """It outranks the bulk book waiting, but has nothing left: the slot goes to the bulk book at once."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    rt.catalog.import_book(make_book("reader", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("bulk", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], priority="interactive")  # the only slot
    regenerate_flow.regenerate(rt.ports, "bulk", ["audio"], priority="bulk")  # waits
    end_here(rt, "reader")
    assert running(rt, "reader", "bulk") == {"bulk": 1}
    assert "reader" not in waiting(rt)


def test_a_book_with_scenes_left_still_waits_at_its_most_urgent_pending_pairs_rank(rt: Wiring) -> None:
    """The other side: a book whose job ends with scenes left queues behind the book it serves, and takes turns."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    rt.catalog.import_book(make_book("a", chapters=1, scenes=3))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    end_here(rt, "a")
    assert running(rt, "a", "b") == {"b": 1}
    assert RANK_SCALE <= waiting(rt)["a"] < 2 * RANK_SCALE  # normal: what it has left


def two_lanes(rt: Wiring) -> None:
    """Audio and image, one slot each, instant builtin jobs, a live consumer on each queue."""
    stages = tuple(
        replace(s, params={**s.params, "steps": 1, "step_seconds": 0}, lane_limit=1)
        for s in rt.settings.registry.stages
    )
    use_settings(rt, replace(rt.settings, registry=replace(rt.settings.registry, stages=stages)))
    advertise(rt, "gpu.audio", "gpu.image")


def test_a_handed_refill_that_finds_nothing_takes_its_book_off_every_list(rt: Wiring) -> None:
    """A place that outlived its book's work (a takeover's, whose pair a pass then claimed) goes once a refill handed
    a slot finds nothing, rather than draw the next slot too."""
    two_lanes(rt)
    rt.catalog.import_book(make_book("done", chapters=1, scenes=1))
    for queue in ("gpu.audio", "gpu.image"):  # stale places, at the head of each lane
        rt.ports.deferrals.wait_for_lane(queue, "done", 0.0)
    refill.refill(rt.ports, "done", "gpu.audio")
    assert "done" not in waiting(rt, "gpu.audio")
    assert "done" not in waiting(rt, "gpu.image")


def test_a_handed_refill_that_finds_nothing_of_its_lane_keeps_the_books_place_on_another(rt: Wiring) -> None:
    two_lanes(rt)
    rt.catalog.import_book(make_book("other", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "other", ["image"])  # the image slot
    regenerate_flow.regenerate(rt.ports, "b", ["image"])  # waits for it
    assert "b" in waiting(rt, "gpu.image")
    rt.ports.deferrals.wait_for_lane("gpu.audio", "b", 0.0)  # a stale place on the audio lane
    refill.refill(rt.ports, "b", "gpu.audio")
    assert "b" not in waiting(rt, "gpu.audio")
    assert "b" in waiting(rt, "gpu.image")


def test_a_stale_place_does_not_keep_the_slot_for_a_book_with_nothing_left(rt: Wiring) -> None:
    """The book's interactive place outranks the normal book waiting, but its job's commit left nothing pending (a
    place left by a takeover's `_wait_again` whose pair a due pass then claimed): the slot goes to the head, and the
    place goes. Kept for the book, the slot went to a refill that found nothing and passed it on through the
    control queue."""
    lane(rt, lane_limit=1)
    now = rt.ports.clock()
    rt.ports.deferrals.wait_for_lane("gpu.audio", "b", wait_score(0, now - 5))  # b: a stale interactive place
    rt.ports.deferrals.wait_for_lane("gpu.audio", "w", wait_score(2, now - 60))  # w: normal, waiting a minute
    taken = rt.ports.deferrals.next_waiters("gpu.audio", 1, exclude="b", ended=("d1", Committed(None)))
    assert taken == ["w"]
    assert waiting(rt) == {}  # the book is not queued again


def test_a_finished_book_on_a_stale_place_hands_the_slot_to_the_waiter_in_the_freeing_process(rt: Wiring) -> None:
    lane(rt, lane_limit=1, book_quota=10, window=10)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("w", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority="interactive")  # the only slot
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])  # waits
    rt.ports.deferrals.wait_for_lane("gpu.audio", "b", wait_score(0, rt.ports.clock() - 5))  # a stale place
    end_here(rt, "b")
    # No control hop: kept, the place also bound the share of w (b waited more urgently), which handed the slot back.
    assert running(rt, "b", "w") == {"w": 1}
    assert "b" not in waiting(rt)
