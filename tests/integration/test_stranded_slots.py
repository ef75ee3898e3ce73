"""A free slot whose refill was lost is handed on by the tick that sees it again, not by reconcile.

Real Postgres, Redis and broker; jobs run in-process, control messages through the real tasks
(`test_elastic_share`'s helpers).
"""

from __future__ import annotations

import time
from dataclasses import replace

from animastor_tasks.flow import gate, refill
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import make_book, use_settings
from .test_elastic_share import finish_one, lane, run_control, running, waiting


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
