"""Round robin on a lane's waiting list: a book served a slot waits behind the books that come to wait before
its job ends, and goes back to the list at that job's end.

Real Postgres, Redis and broker; jobs run in-process (`test_elastic_share.finish_one`).
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from animastor_tasks.domain.deferral import served_since, wait_score
from animastor_tasks.flow import gate, lanes
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.operator import metrics
from animastor_tasks.operator.queue_view import queue_overview

from .helpers import ended_unseen, make_book
from .test_elastic_share import finish_one, lane, run_control, running, waiting


def test_a_book_that_came_while_another_s_job_ran_goes_before_that_book_s_next_job(rt) -> None:
    lane(rt, lane_limit=2, book_quota=2, window=2)
    for book, scenes in (("blocker", 1), ("served", 2), ("late", 1)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "blocker", ["audio"])
    regenerate_flow.regenerate(rt.ports, "served", ["audio"])  # one slot left: its first scene runs, the second waits
    regenerate_flow.regenerate(rt.ports, "late", ["audio"])  # the lane full: it waits, having run nothing
    assert running(rt, "blocker", "served", "late") == {"blocker": 1, "served": 1}
    assert list(waiting(rt)) == ["late", "served"]
    finish_one(rt, "blocker")
    # The freed slot goes to the book that has run nothing yet, not to the second scene of the book served before
    # it came (its share of 2 would have allowed that).
    assert running(rt, "served", "late") == {"served": 1, "late": 1}
    finish_one(rt, "served")  # its job's end puts it back on the list; nobody else waits: it runs its next scene
    assert running(rt, "served", "late") == {"served": 1, "late": 1}
    assert "served" not in waiting(rt)


def test_a_book_whose_regenerate_comes_as_a_slot_frees_does_not_take_it_from_a_book_that_waited_longer(rt) -> None:
    """Old code: the newcomer's first pass saw the slot free (the ended job's refill not yet claimed) and took it, as
    only more urgent waiters kept free slots from a pass; the refill then found the lane full. Of 300 books sent
    together, books sent 75-250 places later first started before books that had waited 1-3 s longer."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book in ("first", "waiter", "newcomer"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "first", ["audio"])  # the one slot
    regenerate_flow.regenerate(rt.ports, "waiter", ["audio"])  # the lane full: it waits, having run nothing
    ended_unseen(rt, "first")  # its job ended; the refill of its slot (in its GPU process) has not claimed yet
    regenerate_flow.regenerate(rt.ports, "newcomer", ["audio"])  # comes in that window, at the same priority
    run_control(rt)
    assert running(rt, "first", "waiter", "newcomer") == {"waiter": 1}
    assert list(waiting(rt)) == ["newcomer", "first", "waiter"]  # the books served since, behind the one that came


@pytest.mark.parametrize("priority", ["normal", "interactive"])
def test_a_book_waiting_at_bulk_takes_no_slot_with_a_more_urgent_pair_from_a_book_that_waited_longer_at_it(
    rt, priority: str
) -> None:
    """Review: its place at bulk, taken since before the waiter came, was compared with the waiter's at `priority`."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book in ("first", "big", "waiter"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "first", ["audio"])  # the one slot
    regenerate_flow.regenerate(rt.ports, "big", ["audio"], [("ch1", "s1")], priority="bulk")  # waits at bulk
    regenerate_flow.regenerate(rt.ports, "waiter", ["audio"], priority=priority)  # waits, placed after big's place
    ended_unseen(rt, "first")  # its job ended; its refill not yet claimed
    regenerate_flow.regenerate(rt.ports, "big", ["audio"], [("ch1", "s2")], priority=priority)  # as the slot frees
    run_control(rt)
    assert running(rt, "first", "big", "waiter") == {"waiter": 1}


def test_a_book_handed_a_slot_claims_it_before_books_that_waited_longer_at_its_priority(rt) -> None:
    """The list's order handed it the slot: the books behind it on the list keep nothing from its refill's claim."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book in ("first", "waiter", "later"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert list(waiting(rt)) == ["waiter", "later"]
    finish_one(rt, "first")  # its refill hands the slot to the head of the list, whose claim takes it
    assert running(rt, "waiter", "later") == {"waiter": 1}
    finish_one(rt, "waiter")
    assert running(rt, "waiter", "later") == {"later": 1}


def test_operators_see_how_many_books_wait_for_each_lane(rt) -> None:
    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book, scenes in (("a", 1), ("b", 2), ("c", 1)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert list(waiting(rt)) == ["b", "c"]  # `a` runs its only scene
    [row] = queue_overview(rt)
    assert (row["in_flight"], row["lane_limit"], row["books_waiting"]) == (1, 1, 2)
    scraped = generate_latest(metrics.build_registry(lambda: rt)).decode()
    assert 'animastor_queue_books_waiting{queue="gpu.audio",stage="audio"} 2.0' in scraped


def test_books_served_one_after_the_other_are_handed_slots_in_that_order(rt) -> None:
    """Old code: every book served waited at one score, and the list ordered them by book id: the slot went to `a`,
    served after `z` and still running a job, whose refill then found its share taken and passed it on."""
    lane(rt, lane_limit=2, book_quota=1, window=10)
    for book in ("z", "a"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "z", ["audio"])  # alone: both slots, its third scene waits
    ended_unseen(rt, "z")  # s1, with no refill: its slot is free
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])  # the free slot, its other two scenes wait
    assert running(rt, "z", "a") == {"z": 1, "a": 1} and set(waiting(rt)) == {"z", "a"}
    ended_unseen(rt, "z")  # s2 likewise
    assert lanes.hand_over(rt.ports, "gpu.audio", 1) == ["z"]  # served first, and nothing of it runs now


def test_a_served_book_refused_again_while_its_job_runs_keeps_its_place_behind_books_that_come_later(rt) -> None:
    """A job longer than the capacity deferral (60 s): the book's waiting scene is refused again while the job runs.
    Old code: that refusal moved the book to its time, ahead of every book that came after it, and the freed slot
    went to the second scene of the book still running its first, not to `late`, which had run nothing."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    for book, scenes in (("blocker", 1), ("served", 2), ("late", 1)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "blocker", ["audio"])
    regenerate_flow.regenerate(rt.ports, "served", ["audio"])  # the last slot: its second scene waits, served
    rt.redis.client.delete(rt.redis.keys.deferrals("served", "capacity"))  # its lane_full deferral ran out
    gate.gate_pass(rt.ports, "served")  # the tick's pass: the lane still full, the scene refused again
    assert list(waiting(rt)) == ["served"]
    regenerate_flow.regenerate(rt.ports, "late", ["audio"])  # comes now, and waits
    assert running(rt, "blocker", "served", "late") == {"blocker": 1, "served": 1}
    finish_one(rt, "blocker")
    assert running(rt, "served", "late") == {"served": 1, "late": 1}
    assert list(waiting(rt)) == ["served"]


def test_a_served_place_gives_way_to_an_urgent_pair_a_head_place_and_a_refusal_after_its_job_could_end(rt) -> None:
    served_at, queue = 1_800_000_000.0, "gpu.audio"

    def refused(rank: int, since: float, job_lasts: float = 60.0) -> float:
        rt.deferrals.wait_for_lane(queue, "b", wait_score(1, served_since(served_at)), served=True)
        rt.deferrals.wait_for_lane(queue, "b", wait_score(rank, since), job_lasts=job_lasts)
        return waiting(rt)["b"]

    assert refused(1, served_at + 59) == wait_score(1, served_since(served_at))  # its job may still run: kept
    assert refused(1, served_at + 61) == wait_score(1, served_at + 61)  # it cannot: the job ended unseen
    assert refused(1, served_at + 59, job_lasts=0) == wait_score(1, served_at + 59)  # a takeover's: the job is gone
    assert refused(0, served_at + 59) == wait_score(0, served_at + 59)  # an interactive pair now waits
    assert refused(1, 0.0) == wait_score(1, 0.0)  # kept at the head of its priority (a slot it was handed)
    rt.redis.client.delete(rt.redis.keys.lane_waiters(queue))
    rt.deferrals.wait_for_lane(queue, "b", wait_score(1, served_at + 30), job_lasts=60)
    assert waiting(rt)["b"] == wait_score(1, served_at + 30)  # a place that is no served one: the better one wins
    rt.deferrals.wait_for_lane(queue, "b", wait_score(1, served_at + 40), job_lasts=60)
    assert waiting(rt)["b"] == wait_score(1, served_at + 30)
