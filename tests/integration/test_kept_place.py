"""A handed refill that cannot read its book (Postgres failing over) keeps the book's place on the waiting list at the
priority it was handed the slot at (`lua/handed_keep.lua`), and a book with nothing pending gets no place: the refill
sent on to the control worker may fail the same way, or find nothing once Postgres is back."""

from __future__ import annotations

import pytest

from animastor_tasks.domain.deferral import RANK_SCALE
from animastor_tasks.domain.vocabulary import Priority, priority_rank
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import refill
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.records import Committed
from animastor_tasks.worker.wiring import Wiring

from .helpers import ended_unseen, make_book
from .test_elastic_share import lane, run_control, running, waiting

LANE = "gpu.audio"


def failing_over(rt: Wiring, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Every refill's read of its book fails from now on, as in a Postgres failover."""

    def down(*args: object, **kwargs: object) -> None:
        raise StoreUnavailable("postgres", rt.settings.database_url, "the server is shutting down")

    monkeypatch.setattr(rt.ports.assets, "gate_candidates", down)
    return monkeypatch


def test_a_refill_that_fails_twice_keeps_a_bulk_book_at_its_own_priority(rt: Wiring, monkeypatch) -> None:
    """The in-process refill's failure kept the book's place and took its hand-over record away; the refill sent on
    to the control worker, failing too with Postgres still failing over, found no record and kept the bulk book at the
    head of `normal`, ahead of every normal waiter."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    for book, scenes in (("x", 1), ("b", 2)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority=Priority.BULK)
    assert running(rt, "x", "b") == {"x": 1}
    dispatch_id = ended_unseen(rt, "x")
    with monkeypatch.context() as failover:
        failing_over(rt, failover)
        refill.free_slot(rt.ports, "x", LANE, dispatch_id, here=True, left=Committed(None))
        assert waiting(rt) == {"b": priority_rank(Priority.BULK) * RANK_SCALE}
        run_control(rt)  # the refill sent on, Postgres still failing over
    assert waiting(rt) == {"b": priority_rank(Priority.BULK) * RANK_SCALE}


def test_a_finished_book_whose_own_refill_fails_gets_no_place_on_the_waiting_list(rt: Wiring, monkeypatch) -> None:
    """Its job's end left nothing pending, so no hand-over record was written; its own refill failed and kept it at
    the head of `normal` with nothing to run, and the refill sent on once Postgres was back (lane None) left it there:
    the next free slot went to it, and on through the control queue."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    rt.catalog.import_book(make_book("x", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"], priority=Priority.BULK)
    assert running(rt, "x") == {"x": 1}
    dispatch_id = ended_unseen(rt, "x")
    with monkeypatch.context() as failover:
        failing_over(rt, failover)
        refill.free_slot(rt.ports, "x", LANE, dispatch_id, here=True, left=Committed(None))
    assert waiting(rt) == {}
    run_control(rt)  # Postgres is back: the refill sent on runs
    assert waiting(rt) == {}


def test_the_refill_of_a_book_s_own_slot_leaves_a_place_it_finds_nothing_for(rt: Wiring) -> None:
    """A place left on the list (kept by a refill that failed) with nothing to run: the book's own refill, run once
    Postgres answers, finds nothing pending and takes it away, as a handed refill does."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    rt.catalog.import_book(make_book("x", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])
    ended_unseen(rt, "x")
    rt.ports.deferrals.wait_for_lane(LANE, "x", priority_rank(Priority.NORMAL) * RANK_SCALE)
    refill.refill(rt.ports, "x", None, slots_of=LANE)
    assert waiting(rt) == {}


def test_a_book_stopped_after_it_was_handed_a_slot_gets_no_place_back(rt: Wiring, monkeypatch) -> None:
    """Stop All took the book off the waiting lists but left its hand-over record: its refill, failing in a Postgres
    failover, kept its place from that record (and a lost refill's record put it back two ticks later), a stopped
    book on the list with nothing to run, drawing the next free slot."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    for book, scenes in (("x", 1), ("b", 2)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    dispatch_id = ended_unseen(rt, "x")
    refill.free_slot(rt.ports, "x", LANE, dispatch_id, left=Committed(None))  # b handed the slot, its refill queued
    assert waiting(rt) == {} and rt.redis.client.hexists(rt.redis.keys.lane_handed(LANE), "b")
    cancel_flow.cancel(rt.ports, "b")
    with monkeypatch.context() as failover:
        failing_over(rt, failover)
        run_control(rt)  # b's refill, Postgres failing over
    assert waiting(rt) == {}
    assert not rt.redis.client.hexists(rt.redis.keys.lane_handed(LANE), "b")  # nothing for a lost refill's restore


def test_a_book_with_no_hand_over_record_keeps_the_place_it_holds_at_the_head_of_its_priority(rt: Wiring) -> None:
    """The script read a missing record as `false` and raised on it (`attempt to perform arithmetic on a boolean`),
    said as 'redis unavailable': the place was not kept, nor the book made due (a hunt, in a Postgres failover)."""
    bulk = priority_rank(Priority.BULK) * RANK_SCALE
    rt.ports.deferrals.wait_for_lane(LANE, "b", bulk + 123.0)
    rt.ports.deferrals.keep_handed_place(LANE, "b")
    assert waiting(rt) == {"b": bulk}
    rt.ports.deferrals.keep_handed_place(LANE, "nowhere")  # neither a record nor a place: none given
    assert waiting(rt) == {"b": bulk}
