"""A book with more pairs in flight than a pass holds at once is passed page by page, to the same ends.

Real Postgres, Redis and broker. `page.PAGE` is made small so that a book of a few scenes spans pages.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
import redis

from animastor_tasks.flow import gate, page, paged_pass
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, states, use_settings
from .test_elastic_share import lane, running
from .test_refill_pass import counting


def generating(rt: Wiring, book: str) -> list[tuple[str, str, str]]:
    return sorted(p for p, s in states(rt, book).items() if s == "generating")


def deferred(rt: Wiring, book: str, bucket: str = "capacity") -> set[str]:
    return set(rt.redis.client.zrange(rt.redis.keys.deferrals(book, bucket), 0, -1))


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(page, "PAGE", 7)
    return 7


def test_a_big_book_fills_the_free_slots_in_reading_order_and_defers_the_rest(rt: Any, small_pages: int) -> None:
    lane(rt, lane_limit=3, book_quota=3, window=3)
    rt.catalog.import_book(make_book("big", chapters=1, scenes=30))  # 30 pending pairs: five pages
    regenerate_flow.regenerate(rt.ports, "big", ["audio"])
    assert generating(rt, "big") == [("ch1", f"s{i}", "audio") for i in (1, 2, 3)]
    # The regenerate's own pass ran paged: every other pair waits with its reason, the book for the lane.
    assert deferred(rt, "big") == {f"ch1:s{i}:audio" for i in range(4, 31)}
    assert rt.redis.client.zscore(rt.redis.keys.lane_waiters("gpu.audio"), "big") is not None
    report = gate.gate_pass(rt.ports, "big")  # a pass over deferred pairs: decides, writes nothing
    assert report.authorized_count == 30 and report.authorized == [] and report.dispatched == []
    assert running(rt, "big") == {"big": 3}


def test_a_big_book_releases_what_lost_its_authority_on_every_page(rt: Any, small_pages: int) -> None:
    lane(rt, lane_limit=2)
    rt.catalog.import_book(make_book("big", chapters=2, scenes=10))
    regenerate_flow.regenerate(rt.ports, "big", ["audio"])
    with rt.db.transaction() as conn:  # the layer turned off behind the gate's back
        conn.execute("UPDATE books SET layer_config = '{\"audio_enabled\": false}' WHERE book_id = 'big'")
    report = gate.gate_pass(rt.ports, "big")
    assert len(report.released) == 18  # every pending pair, whichever page it was on
    assert list(states(rt, "big").values()).count("dirty") == 18


def test_a_big_book_s_finished_scenes_leave_the_active_index_in_reconcile_s_pass(rt: Any, small_pages: int) -> None:
    lane(rt, lane_limit=2)
    rt.catalog.import_book(make_book("big", chapters=1, scenes=20))
    regenerate_flow.regenerate(rt.ports, "big", ["audio"])
    with rt.db.transaction() as conn:  # five scenes finished (as if their jobs had committed)
        conn.execute(
            "UPDATE asset_states SET state = 'ready' WHERE book_id = 'big'"
            " AND scene_id = ANY(ARRAY['s11', 's12', 's13', 's14', 's15'])"
        )
    gate.gate_pass(rt.ports, "big")  # a dispatching pass leaves that to reconcile's
    assert rt.redis.client.scard(rt.redis.keys.active_scenes("big")) == 20
    gate.gate_pass(rt.ports, "big", dispatch_work=False)  # reconcile's pass
    active = rt.redis.client.smembers(rt.redis.keys.active_scenes("big"))
    assert len(active) == 15 and not {f"ch1:s{i}" for i in range(11, 16)} & active


def test_a_book_whose_active_index_is_bigger_than_a_page_makes_no_limited_read_first(rt: Any, small_pages: int) -> None:
    lane(rt, lane_limit=2)
    rt.catalog.import_book(make_book("big", chapters=1, scenes=20))
    regenerate_flow.regenerate(rt.ports, "big", ["audio"])
    counter = counting(rt)
    report = gate.gate_pass(rt.ports, "big")
    assert counter.full_reads == 0  # the active index said 20 scenes: the pages at once
    assert report.authorized_count == 20 and running(rt, "big") == {"big": 2}


def test_an_unknown_book_with_a_big_active_index_leaves_the_indexes(rt: Any, small_pages: int) -> None:
    lane(rt, lane_limit=2)
    rt.ports.book_state.activate({"gone": [("ch1", f"s{i}") for i in range(20)]})  # no such book in Postgres
    assert "gone" in rt.ports.book_state.active_books()
    report = gate.gate_pass(rt.ports, "gone")
    assert report.error is None and report.dispatched == []
    assert rt.redis.client.scard(rt.redis.keys.active_scenes("gone")) == 0
    assert "gone" not in rt.ports.book_state.active_books()


def open_transactions(rt: Wiring) -> int:
    """Sessions of the test database, other than this query's own, left inside a transaction."""
    with rt.db.read() as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
        ).fetchone()
    return int(row[0]) if row else -1


def test_a_pass_between_its_pages_holds_no_lock_a_table_lock_would_wait_for(rt: Any, small_pages: int) -> None:
    """Its cursor's transaction held asset_states from the first page to the last: a table lock asked for meanwhile
    (an ALTER TABLE, a VACUUM FULL) queued the pass's own next statement behind it, a wait through the client that
    Postgres sees as no deadlock, and the pass and every reader of the table hung until the lock's asker gave up.
    Now the cursor is held past its transaction: between pages, such a lock is granted at once."""
    lane(rt, lane_limit=2)
    rt.catalog.import_book(make_book("big", chapters=1, scenes=30))
    regenerate_flow.regenerate(rt.ports, "big", ["audio"])
    pages = paged_pass._pages(rt.ports, "big", time.time(), rt.ports.settings.registry.queues())
    try:
        rows, snap = next(pages)  # the second page is being read meanwhile
        assert len(rows.in_flight) == small_pages // 2 - 1  # a read is half a page; the first holds the book's row
        assert snap.deferred["capacity"] == {i.pair for i in rows.in_flight} - set(generating(rt, "big"))
        assert open_transactions(rt) == 0
        with rt.db.transaction() as conn:  # the old code: LockNotAvailable
            conn.execute("LOCK TABLE asset_states IN ACCESS EXCLUSIVE MODE NOWAIT")
        rest = list(pages)  # and the pass goes on, once the lock is let go
    finally:
        pages.close()  # a pass stopped by an error after its first page (and the test's own cursor, if it fails)
    assert sum(len(r.in_flight) for r, _ in rest) == 30 - len(rows.in_flight)
    assert open_transactions(rt) == 0


def test_every_page_is_read_once_in_order_with_its_own_snapshot(rt: Any, small_pages: int) -> None:
    lane(rt, lane_limit=2)
    rt.catalog.import_book(make_book("big", chapters=1, scenes=30))
    regenerate_flow.regenerate(rt.ports, "big", ["audio"])
    read = list(paged_pass._pages(rt.ports, "big", time.time(), rt.ports.settings.registry.queues()))
    pairs = [i.pair for rows, _ in read for i in rows.in_flight]
    assert sorted(pairs) == sorted(("ch1", f"s{i}", "audio") for i in range(1, 31)) and len(pairs) == 30
    for rows, snap in read:  # each snapshot holds the deferrals of its own page's pairs, no other
        assert snap.deferred["capacity"] == {i.pair for i in rows.in_flight} - set(generating(rt, "big"))
    assert open_transactions(rt) == 0


def test_a_slot_freed_while_a_big_book_joins_a_full_lanes_waiting_list_is_handed_on(
    rt: Any, small_pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pages count the lanes without a lock and their pairs wait for a full one without a claim. A job that
    ended between that count and the book joining the lane's waiting list found nobody to hand its slot to:
    the slot idled beside the waiting book until another job of the lane ended."""
    registry = rt.settings.registry
    instant = {"steps": 1, "step_seconds": 0}
    stages = tuple(replace(registry.get(s), params=instant, lane_limit=2) for s in ("audio", "image"))
    use_settings(rt, replace(rt.settings, registry=replace(registry, stages=stages)))
    advertise(rt, "gpu.audio", "gpu.image")
    rt.catalog.import_book(make_book("other", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "other", ["audio"])  # the audio lane: full
    rt.catalog.import_book(make_book("big", chapters=1, scenes=20))
    regenerate_flow.regenerate(rt.ports, "big", ["image"])  # older: its pairs come first (the image lane: full)
    regenerate_flow.regenerate(rt.ports, "big", ["audio"])
    assert running(rt, "other", "big") == {"other": 2, "big": 2}
    rt.redis.client.delete(rt.redis.keys.deferrals("big", "capacity"))  # they lapsed: the tick's pass of the book
    for queue in ("gpu.audio", "gpu.image"):
        rt.redis.client.delete(rt.redis.keys.lane_waiters(queue))
    broker = redis.Redis.from_url(rt.settings.broker_url)
    broker.delete("animastor.control")
    counted = page.lanes_without_room

    def count_then_a_job_ends(ports: Any) -> set[str]:
        full = counted(ports)
        if "gpu.audio" in full:  # an audio job of `other` commits now; its end finds nobody waiting
            with rt.db.transaction() as conn:
                conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'other' AND scene_id = 's1'")
        return full

    monkeypatch.setattr(page, "lanes_without_room", count_then_a_job_ends)
    gate.gate_pass(rt.ports, "big")
    assert rt.redis.client.zscore(rt.redis.keys.lane_waiters("gpu.audio"), "big") is None  # served
    [message] = broker.lrange("animastor.control", 0, -1)
    broker.close()
    assert b"animastor.refill" in message and b"gpu.audio" in message, message


def test_after_a_redis_loss_a_page_reads_the_forced_pairs_of_its_own_pairs_only(rt: Any) -> None:
    """For a force window after a Redis data loss, each page of a big book's pass read the forced pairs of the whole
    book (`dispatch.dispatch_pending`): a pass of 100,000 pairs read 2.2 million rows, 5.9 s against 0.6."""
    lane(rt, lane_limit=1)
    rt.catalog.import_book(make_book("big", chapters=1, scenes=30))
    regenerate_flow.regenerate(rt.ports, "big", ["audio"], force=True)
    asked = [("ch1", "s2", "audio"), ("ch1", "s7", "audio"), ("ch1", "s30", "audio"), ("ch1", "s99", "audio")]
    found = rt.ports.commands.forced_in_flight("big", 120, asked)
    assert sorted(pair for pair, _ in found) == sorted(asked[:3])  # s99: no such scene
    assert all(0 < left <= 120 for _, left in found)
    assert rt.ports.commands.forced_in_flight("big", 120, []) == []
