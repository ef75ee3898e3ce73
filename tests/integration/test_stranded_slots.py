"""A free slot whose refill was lost is handed on by the tick that sees it again, not by reconcile.

Real Postgres, Redis and broker; jobs run in-process, control messages through the real tasks
(`test_elastic_share`'s helpers).
"""

from __future__ import annotations

import time
from dataclasses import replace

import redis

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.domain.vocabulary import Priority
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, refill
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.records import Committed

from .helpers import ended_unseen, make_book, use_settings
from .test_claimed_hold import _refills
from .test_elastic_share import finish_one, hand_over_while_postgres_fails_over, lane, run_control, running, waiting


def a_slot_whose_refill_was_lost(rt, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`a` holds both slots of the lane and `w` waits for it; one job of `a` ends and its refill never runs (its
    process died between its commit and its refill). Ticks may come every 0.2 s."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    use_settings(rt, replace(rt.settings, tick_seconds=0.2))
    rt.catalog.import_book(make_book("a", chapters=1, scenes=2))
    rt.catalog.import_book(make_book("w", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])
    assert running(rt, "a", "w") == {"a": 2} and list(waiting(rt)) == ["w"]
    with monkeypatch.context() as lost:
        lost.setattr(refill, "free_slot", lambda *_a, **_k: None)
        finish_one(rt, "a")
    assert running(rt, "a", "w") == {"a": 1}


def test_a_slot_freed_without_its_refill_goes_to_the_waiting_book_on_the_next_tick(rt, monkeypatch) -> None:
    """The process that freed it died after its commit: the slot stood free beside the waiting book until
    reconcile counted the lanes (30 s). A tick leaves a free slot to the refill on its way; the next one hands it."""
    a_slot_whose_refill_was_lost(rt, monkeypatch)
    gate.tick(rt.ports)
    run_control(rt)
    assert running(rt, "a", "w") == {"a": 1}  # seen once: a refill may be on its way
    time.sleep(0.3)
    gate.tick(rt.ports)
    run_control(rt)
    assert running(rt, "a", "w") == {"a": 1, "w": 1}


def test_books_waiting_for_an_open_breaker_are_no_stranded_slot_alarm(rt, caplog) -> None:
    """The books a breaker refused wait on the lane's list beside its free slots: each other tick warned that free
    slots stood beside waiting books (a lost refill, for an operator), for as long as the breaker stayed open."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    use_settings(rt, replace(rt.settings, tick_seconds=0.2))
    rt.redis.client.hset(rt.redis.keys.breaker("gpu.audio"), mapping={"open_until": rt.redis.server_time() + 60})
    rt.catalog.import_book(make_book("w", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])
    assert list(waiting(rt)) == ["w"] and running(rt, "w") == {}
    for _ in range(3):
        gate.tick(rt.ports)
        time.sleep(0.3)
    assert "stood beside waiting books" not in caplog.text
    assert list(waiting(rt)) == ["w"]


def test_a_tick_hands_nothing_on_for_a_lane_that_was_full_or_had_nobody_waiting_before(rt) -> None:
    """Slots are free for a moment on a busy lane at every tick; only one seen so on two ticks running is handed."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    use_settings(rt, replace(rt.settings, tick_seconds=0.2))
    rt.catalog.import_book(make_book("a", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    finish_one(rt, "a")  # refilled at once: full again
    gate.tick(rt.ports)
    seen = rt.redis.client.hgetall(rt.redis.keys.lanes_seen_free())
    assert seen == {}  # nobody waits for the lane
    rt.ports.deferrals.wait_for_lane("gpu.audio", "someone", 0)
    time.sleep(0.3)
    gate.tick(rt.ports)  # full: no sighting
    assert rt.redis.client.hgetall(rt.redis.keys.lanes_seen_free()) == {}


def test_a_stranded_slot_that_cannot_be_handed_on_costs_the_tick_nothing_else(rt, monkeypatch) -> None:
    """A broker refusing the hand-over's refill must not keep the tick from sending the due books' passes."""
    a_slot_whose_refill_was_lost(rt, monkeypatch)
    gate.tick(rt.ports)
    time.sleep(0.3)
    rt.ports.book_state.set_due("due-book", 0.0)

    def refused(*_a, **_k):  # type: ignore[no-untyped-def]
        raise ConnectionError("broker refused")

    monkeypatch.setattr(rt.ports.publisher, "enqueue_refill", refused)
    assert gate.tick(rt.ports) == ["due-book"]


def lost_control_messages(rt) -> int:  # type: ignore[no-untyped-def]
    """The control worker died running what waited in its queue (its tasks are acked early): all of it gone."""
    client = redis.Redis.from_url(rt.settings.broker_url)
    try:
        return int(client.delete(CONTROL_QUEUE))
    finally:
        client.close()


def test_a_book_handed_a_slot_whose_refill_was_lost_gets_the_slot_within_a_few_ticks(rt) -> None:
    """Old code: the hand-over took `w` off the waiting list and its refill was lost (a control worker killed
    running it); with nobody left on the list the tick saw no stranded slot, and `w`'s pairs waited out their
    capacity deferral (60 s) beside the free slot. Now a hand-over whose refill never reported back puts its book
    back at its place after two ticks, and the tick after hands the slot on."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    use_settings(rt, replace(rt.settings, tick_seconds=0.2))
    for book in ("a", "w"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    regenerate_flow.regenerate(rt.ports, "w", ["audio"], priority="bulk")  # refused lane_full: waits
    place = waiting(rt)["w"]
    cancel_flow.cancel(rt.ports, "a")  # a's slot frees and is handed to w
    assert waiting(rt) == {} and lost_control_messages(rt) == 1
    deadline = time.monotonic() + 5.0
    while running(rt, "w") != {"w": 1} and time.monotonic() < deadline:
        time.sleep(0.1)
        gate.tick(rt.ports)
        before = dict(waiting(rt))
        run_control(rt)
        if "w" in before:
            assert before["w"] == place  # back at its own place (bulk, since it first waited)
    assert running(rt, "w") == {"w": 1}
    rt.counters.flush()
    assert rt.redis.client.hget(rt.redis.keys.metrics(), "lost_refill:audio") == "1"  # animastor_lost_refills_total


def test_a_refill_still_queued_behind_a_control_backlog_counts_as_late_not_lost(rt) -> None:
    """Old code: a burst of commands kept the refill queued past two ticks, and it counted as lost (the warning and
    `animastor_lost_refills_total`, which tells operators that control workers die mid-task) although nothing died."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    use_settings(rt, replace(rt.settings, tick_seconds=0.2))
    for book in ("a", "w"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])
    cancel_flow.cancel(rt.ports, "a")  # a's slot is handed to w; its refill waits in the control queue, not run
    time.sleep(0.5)  # two ticks and more
    gate.tick(rt.ports)
    assert "w" in waiting(rt)  # put back at its place all the same: the slot is not left to the refill alone
    rt.counters.flush()
    counted = rt.redis.client.hgetall(rt.redis.keys.metrics())
    assert counted.get("late_refill:audio") == "1" and "lost_refill:audio" not in counted
    run_control(rt)  # the late refill runs at last
    assert running(rt, "w") == {"w": 1}


def test_a_handed_refill_that_cannot_read_its_book_keeps_the_book_s_own_priority(rt, monkeypatch) -> None:
    """Old code: the book kept its place at the head of the *interactive* priority (score 0), whatever it waited
    with, and went ahead of a reader's interactive scene on the next free slot."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book in ("x", "b"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority="bulk")
    assert int(waiting(rt)["b"] // 1e10) == 2
    hand_over_while_postgres_fails_over(rt, monkeypatch, exclude="x")
    assert waiting(rt)["b"] == 2e10  # at the head of its own priority, not of the interactive one
    assert rt.redis.client.hgetall(rt.redis.keys.lane_handed("gpu.audio")) == {}


def test_a_refill_takes_away_its_own_hand_over_record_but_not_one_of_a_later_hand_over(rt) -> None:
    """Keyed by book alone, the first refill to end took away the record of a second hand-over of the same book,
    and that one's refill, lost, was never put right."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    record, now = rt.redis.keys.lane_handed("gpu.audio"), rt.ports.clock()
    rt.redis.client.hset(record, "b", f"{now} 1e10")
    refill.refill(rt.ports, "b", "gpu.audio")
    assert rt.redis.client.hget(record, "b") is None
    rt.redis.client.hset(record, "b", f"{now + 5} 1e10")  # handed again after this refill began
    refill.refill(rt.ports, "b", "gpu.audio")
    assert rt.redis.client.hget(record, "b") == f"{now + 5} 1e10"


def test_slots_handed_moments_ago_are_not_stranded_ones(rt) -> None:
    """A tick saw a slot free for the few milliseconds before its job's refill claimed it; the next tick saw two
    other slots free, handed through the control queue moments ago to two readers' books, and handed them again as
    stranded, to two normal books, whose refills ran first (a second control process) and took them: the readers'
    scenes waited a whole job. The tick hands on only what is free beside the slots handed moments ago."""
    lane(rt, lane_limit=3, book_quota=3, window=3)
    use_settings(rt, replace(rt.settings, tick_seconds=0.2))
    for book, scenes in (("a", 3), ("w", 1), ("i1", 1), ("i2", 1), ("n1", 1), ("n2", 1)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])
    assert running(rt, "a") == {"a": 3} and list(waiting(rt)) == ["w"]
    first = ended_unseen(rt, "a")
    gate.tick(rt.ports)  # a free slot beside a waiting book, its refill a few milliseconds behind
    assert not _refills(rt)
    refill.free_slot(rt.ports, "a", "gpu.audio", first, here=True, left=Committed(None))
    assert running(rt, "a", "w") == {"a": 2, "w": 1}
    for book in ("i1", "i2"):
        regenerate_flow.regenerate(rt.ports, book, ["audio"], priority=Priority.INTERACTIVE)
    for book in ("n1", "n2"):
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    time.sleep(0.3)
    for _ in range(2):  # two jobs of `a` fail: their slots handed to i1 and i2 through the control queue
        refill.free_slot(rt.ports, "a", "gpu.audio", ended_unseen(rt, "a"), left=Committed(None))
    gate.tick(rt.ports)
    sent = _refills(rt)
    assert sorted(sent) == ["i1", "i2"], sorted(sent)  # nothing handed twice
    for book in ("i1", "i2"):
        sent[book]()
    assert running(rt, "i1", "i2", "n1", "n2") == {"i1": 1, "i2": 1}
