"""A book handed a slot whose refill has not claimed yet (off the waiting list, in the lane's hand-over record) still
waits for the slots the list leaves, at the priority it was handed the slot at (`lua/lane_take.lua`). *Why:* two job
ends moments apart: the second end's hand-over did not see the book the first had served, so a reader's second
interactive scene waited a whole bulk job while the bulk book kept the slot, and a slot a pass handed on for want of
use went to nobody beside a book with more pairs than its one handed slot, idle until the tick's stranded check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from animastor_tasks.adapters.redis.deferrals import DeferralStore
from animastor_tasks.domain.capacity import HANDED_HOLD_SECONDS
from animastor_tasks.domain.deferral import wait_score
from animastor_tasks.domain.keys import pair_member
from animastor_tasks.domain.vocabulary import DeferralBucket, Outcome, Priority, priority_rank
from animastor_tasks.flow import refill
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.page import PassReport
from animastor_tasks.records import Committed
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, end_job, make_book, states, use_settings
from .test_elastic_share import run_control, waiting

LANE = "gpu.audio"
INTERACTIVE, NORMAL, BULK = (priority_rank(p) for p in (Priority.INTERACTIVE, Priority.NORMAL, Priority.BULK))
Held = list[tuple[tuple[Any, ...], dict[str, Any]]]


def two_lanes(rt: Wiring, **limits: Any) -> None:
    """Audio and image stages with the same `limits` and instant builtin jobs, live consumers on both queues."""
    stages = tuple(replace(s, params={"steps": 1, "step_seconds": 0}, **limits) for s in rt.settings.registry.stages)
    use_settings(rt, replace(rt.settings, registry=replace(rt.settings.registry, stages=stages)))
    advertise(rt, "gpu.audio", "gpu.image")


def held_refills(monkeypatch: pytest.MonkeyPatch) -> tuple[Held, Callable[[], None]]:
    """Refills run in a job's process are held (their processes slow) until the second callable is called."""
    held: Held = []
    real = refill.refill
    monkeypatch.setattr(refill, "refill", lambda *a, **k: held.append((a, k)) or PassReport(a[1]))
    return held, lambda: monkeypatch.setattr(refill, "refill", real)


def generating(rt: Wiring, stage: str) -> list[str]:
    return sorted(
        b
        for b in ("x", "y", "bulk", "bulk2", "reader")
        for (_, _, st), s in states(rt, b).items()
        if s == "generating" and st == stage
    )


def pending(rt: Wiring, book: str, stage: str) -> int:
    return sum(1 for (_, _, st), s in states(rt, book).items() if s == "pending" and st == stage)


def test_two_bulk_jobs_ending_together_both_go_to_the_reader_s_interactive_scenes(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first end hands the reader one slot; the second end's list is empty (the reader off it, its refill on its
    way). Old code: the bulk book kept the second slot for a bulk scene (`['bulk', 'reader']`)."""
    two_lanes(rt, lane_limit=2, book_quota=4, window=4)
    rt.catalog.import_book(make_book("bulk", chapters=1, scenes=6))
    rt.catalog.import_book(make_book("reader", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "bulk", ["image"], priority=Priority.BULK)
    regenerate_flow.regenerate(rt.ports, "reader", ["image"], [["ch1", "s1"], ["ch1", "s2"]], priority="interactive")
    assert generating(rt, "image") == ["bulk", "bulk"]
    held, release = held_refills(monkeypatch)
    end_job(rt, "bulk", "s1", "image")
    end_job(rt, "bulk", "s2", "image")
    release()
    assert [a[1] for a, _ in held] == ["reader", "reader"]
    for args, kwargs in reversed(held):  # the second process runs its refill first
        refill.refill(*args, **kwargs)
    run_control(rt)
    assert generating(rt, "image") == ["reader", "reader"]


@pytest.mark.parametrize("other", [Priority.BULK, Priority.NORMAL])
def test_a_handed_reader_outranks_the_head_of_the_list_at_the_second_end(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch, other: Priority
) -> None:
    """As above, with another bulk (or normal) book listed behind the reader: at the second end the list's head is
    that book, as urgent as the finishing one or more, while the reader, handed the first slot, is off the list, its
    refill on its way. Old code: the head took the second slot (`['bulk2', 'reader']`, the reader's s2 pending)."""
    two_lanes(rt, lane_limit=2, book_quota=4, window=4)
    for book, scenes in (("bulk", 4), ("reader", 3), ("bulk2", 4)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "bulk", ["image"], priority=Priority.BULK)
    regenerate_flow.regenerate(rt.ports, "bulk2", ["image"], priority=other)
    regenerate_flow.regenerate(rt.ports, "reader", ["image"], priority="interactive")
    assert generating(rt, "image") == ["bulk", "bulk"]
    assert list(waiting(rt, "gpu.image"))[:1] == ["reader"]
    held, release = held_refills(monkeypatch)
    end_job(rt, "bulk", "s1", "image")
    end_job(rt, "bulk", "s2", "image")
    release()
    for args, kwargs in reversed(held):
        refill.refill(*args, **kwargs)
    run_control(rt)
    assert generating(rt, "image") == ["reader", "reader"]
    assert [a[1] for a, _ in held] == ["reader", "reader"]


def test_a_slot_a_handed_pass_cannot_use_goes_to_the_book_handed_one_moments_ago(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two audio jobs end together: x is handed the first slot, but its scene window is full (its image jobs), so its
    pass hands the slot on; y, handed the second slot, is off the list, its refill claiming only that one. Old code:
    the slot went to nobody (`hand_over` found an empty list) and idled beside y's pair until the tick's stranded
    check, two sightings later."""
    two_lanes(rt, lane_limit=2, book_quota=2, window=2)
    rt.catalog.import_book(make_book("x", chapters=1, scenes=4))
    rt.catalog.import_book(make_book("y", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "x", ["all"])  # alone: audio s1 s2, image s1 s2
    regenerate_flow.regenerate(rt.ports, "y", ["audio"])  # waits for the audio lane
    end_job(rt, "x", "s1", "audio")  # its slot goes to y
    run_control(rt)
    assert generating(rt, "audio") == ["x", "y"]
    assert list(waiting(rt)) == ["x", "y"]
    held, release = held_refills(monkeypatch)
    end_job(rt, "y", "s1", "audio")  # x is handed the slot; its refill in a slow process
    release()
    ((x_args, x_kwargs),) = held
    assert x_args[1:3] == ("x", LANE)
    snapshot = rt.ports.book_state.pair_snapshot

    fired: list[bool] = []

    def read_then_x_s_job_ends(*args: Any, **kwargs: Any) -> Any:
        snap = snapshot(*args, **kwargs)
        if not fired:  # meanwhile x's other audio job ends elsewhere: y is handed that slot
            fired.append(True)
            monkeypatch.setattr(refill, "refill", lambda *a, **k: held.append((a, k)) or PassReport(a[1]))
            end_job(rt, "x", "s2", "audio")
            release()
        return snap

    monkeypatch.setattr(rt.ports.book_state, "pair_snapshot", read_then_x_s_job_ends)
    report = refill.refill(*x_args, **x_kwargs)
    monkeypatch.setattr(rt.ports.book_state, "pair_snapshot", snapshot)
    assert report.outcomes == {Outcome.WINDOW_FULL: 2}
    ((y_args, y_kwargs),) = held[1:]
    assert y_args[1:3] == ("y", LANE)
    refill.refill(*y_args, **y_kwargs)  # y's refill: its one slot
    run_control(rt)
    assert generating(rt, "audio") == ["y", "y"]  # no free slot beside y's pairs
    assert pending(rt, "y", "audio") == 0


# The hand-over record itself, through `DeferralStore.next_waiters` (lua/lane_take.lua).


def handed(rt: Wiring, book: str, rank: int, ago: float = 0.0) -> float:
    """`book` handed a slot of the lane `ago` seconds ago at the head of `rank`, off the list: its record's time."""
    at = rt.redis.server_time() - ago
    rt.redis.client.hset(rt.redis.keys.lane_handed(LANE), book, f"{at!r} {wait_score(rank, 0.0)!r}")
    return at


def record(rt: Wiring) -> dict[str, list[float]]:
    raw = rt.redis.client.hgetall(rt.redis.keys.lane_handed(LANE))
    return {str(k): [float(x) for x in str(v).split(" ")] for k, v in raw.items()}


def ended(rt: Wiring, book: str, rank: int | None) -> tuple[str, Committed]:
    """A job of `book` ended leaving it its most urgent pending pair at `rank` (None: nothing); one pair of it
    deferred for capacity."""
    rt.redis.client.zadd(
        rt.redis.keys.deferrals(book, DeferralBucket.CAPACITY), {pair_member("ch1", "s9", "audio"): 1e12}
    )
    return "d1", Committed(rank)


def deferred(rt: Wiring, book: str) -> int:
    return int(rt.redis.client.zcard(rt.redis.keys.deferrals(book, DeferralBucket.CAPACITY)))


def store(rt: Wiring) -> DeferralStore:
    return rt.ports.deferrals  # type: ignore[return-value]


def test_a_slot_handed_on_goes_to_a_handed_book_nobody_listed_and_its_record_is_the_new_refill_s(rt: Wiring) -> None:
    """Handed again, its record is as of now: a refill begun before leaves it, the refill sent now takes it away."""
    first = handed(rt, "r", NORMAL, ago=0.5)
    assert store(rt).next_waiters(LANE, 1, exclude="p") == ["r"]  # a pass of p hands on a slot it cannot use
    again, score = record(rt)["r"]
    assert again > first and score == wait_score(NORMAL, 0.0)
    store(rt).hand_over_done(LANE, "r", again - 0.1)  # the first refill, begun before the second hand-over
    assert "r" in record(rt)
    store(rt).hand_over_done(LANE, "r", again + 0.1)
    assert record(rt) == {}


def test_a_record_past_the_hold_holds_nothing(rt: Wiring) -> None:
    """Its refill was likely lost: the tick puts the book back on the list (`handed_restore.lua`)."""
    handed(rt, "r", INTERACTIVE, ago=HANDED_HOLD_SECONDS + 1)
    assert store(rt).next_waiters(LANE, 1, exclude="p") == []


def test_books_handed_by_the_same_hand_over_are_left_to_its_last_refill(rt: Wiring) -> None:
    """x, handed a slot with y, has no use for it: the hand-over's last refill hands on what is still free
    (`refill._close_hand_over`), so y is not handed another now; a book handed by another hand-over is."""
    for book, since in (("x", 1.0), ("y", 2.0)):
        store(rt).wait_for_lane(LANE, book, wait_score(NORMAL, since))
    assert store(rt).next_waiters(LANE, 2) == ["x", "y"]
    assert store(rt).next_waiters(LANE, 1, exclude="x") == []
    handed(rt, "z", BULK)
    assert store(rt).next_waiters(LANE, 1, exclude="x") == ["z"]


def test_a_more_urgent_handed_book_takes_the_slot_the_freeing_book_would_keep(rt: Wiring) -> None:
    """The book whose job ended (more urgent than the bulk book listed) queues; its capacity deferrals stay
    (somebody else took the slot)."""
    handed(rt, "reader", INTERACTIVE)
    store(rt).wait_for_lane(LANE, "bulk", wait_score(BULK, 5.0))
    assert store(rt).next_waiters(LANE, 1, exclude="b", ended=ended(rt, "b", NORMAL)) == ["reader"]
    assert list(waiting(rt)) == ["b", "bulk"] and deferred(rt, "b") == 1


@pytest.mark.parametrize("left", [BULK, None, "handing on"])
def test_a_more_urgent_handed_book_goes_before_the_head_of_the_list(rt: Wiring, left: int | str | None) -> None:
    """The list's head as urgent as the freeing book or more (or that book left nothing pending, or it hands a slot
    on): a handed book more urgent than the head takes the slot, the head keeps its place."""
    handed(rt, "reader", INTERACTIVE)
    store(rt).wait_for_lane(LANE, "bulk", wait_score(BULK, 5.0))
    end = None if left == "handing on" else ended(rt, "b", left if isinstance(left, int) else None)
    assert store(rt).next_waiters(LANE, 1, exclude="b", ended=end) == ["reader"]
    assert list(waiting(rt))[:1] == ["bulk"]


@pytest.mark.parametrize("rank", [NORMAL, BULK])
def test_a_handed_book_no_more_urgent_than_the_freeing_book_leaves_it_the_slot(rt: Wiring, rank: int) -> None:
    """As urgent (it was just served) or less: the freeing book keeps the slot as when nobody waits, its capacity
    deferrals cleared, off the list, its own record written."""
    handed(rt, "h", rank)
    assert store(rt).next_waiters(LANE, 1, exclude="b", ended=ended(rt, "b", NORMAL)) == []
    assert waiting(rt) == {} and deferred(rt, "b") == 0 and set(record(rt)) == {"h", "b"}


def test_a_finished_book_s_slot_goes_to_its_own_refill_which_passes_it_on(rt: Wiring) -> None:
    """Nothing left pending: its own refill moves its scene window (another stage's pairs may go), then passes the
    slot on (to the handed book, through `hand_over`)."""
    handed(rt, "h", NORMAL)
    assert store(rt).next_waiters(LANE, 1, exclude="b", ended=ended(rt, "b", None)) == []
    assert store(rt).next_waiters(LANE, 1, exclude="b") == ["h"]


def test_handed_books_more_urgent_than_the_listed_ones_go_before_them(rt: Wiring) -> None:
    """A handed book on the list again (its refill refused a pair) counts once, at its place. A hand-over by no book
    (a count of the lanes: it subtracts the slots handed books hold) takes the listed ones alone."""
    store(rt).wait_for_lane(LANE, "n", wait_score(NORMAL, 5.0))
    store(rt).wait_for_lane(LANE, "back", wait_score(BULK, 1.0))
    for book, rank in (("i", INTERACTIVE), ("n2", NORMAL), ("b", BULK), ("back", INTERACTIVE)):
        handed(rt, book, rank)
    assert store(rt).next_waiters(LANE, 4, exclude="p") == ["i", "n"]
    assert list(waiting(rt)) == ["back"]
    assert store(rt).next_waiters(LANE, 4) == ["back"]
    assert store(rt).next_waiters(LANE, 4) == []
