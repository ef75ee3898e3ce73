"""A book with commanded work never drops off the due index for longer than a tick or two: only reconcile's round
brought such a book back, and that round is paged (`ANIMASTOR_RECONCILE_PAIRS` per run), minutes at scale.

Real Postgres, Redis and broker; control messages are run through the real tasks (`run_control`). Reconcile passes
five pairs a run here, so that a round takes several runs, as on a big farm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import redis

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import gate, page
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.ports import Ports
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, states, use_settings
from .test_elastic_share import lane, run_control, running

BOOKS = [f"b{i:02d}" for i in range(12)]


def tick(rt: Wiring) -> list[str]:
    rt.redis.client.delete(rt.redis.keys.lock("tick"))
    return gate.tick(rt.ports)


def due(rt: Wiring) -> set[str]:
    return {str(b) for b in rt.redis.client.zrange(rt.redis.keys.due(), 0, -1)}


def generating(rt: Wiring, book: str) -> bool:
    return "generating" in states(rt, book).values()


def failing_once(rt: Wiring, monkeypatch: pytest.MonkeyPatch, book: str) -> list[str]:
    """`set_due` of `book` raises once (Redis reset the connection); the books it failed for."""
    real, failed = rt.ports.book_state.set_due, []

    def once(name: str, when: float) -> None:
        if name == book and not failed:
            failed.append(name)
            raise StoreUnavailable("redis", rt.settings.redis_url, "connection reset by peer")
        real(name, when)

    monkeypatch.setattr(rt.ports.book_state, "set_due", once)
    return failed


def awaiting_workers(rt: Wiring) -> None:
    """Twelve books of one audio pair each, regenerated while Redis had just come back: no worker's presence is
    sure, so every pass holds its pairs and asks for the book's next pass at once (the due index)."""
    lane(rt, lane_limit=100)
    use_settings(rt, replace(rt.settings, reconcile_pairs=5))
    for book in BOOKS:
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    reconcile_flow.reconcile(rt.ports, force=True)  # a bookmark: a round under way, as on a live farm
    rt.redis.recovered_at = rt.ports.clock()
    rt.redis.client.delete(rt.redis.keys.consumers("gpu.audio"))
    for book in BOOKS:
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert due(rt) == set(BOOKS)


def test_a_due_write_that_fails_after_a_good_pass_leaves_the_book_due(rt: Wiring, monkeypatch) -> None:
    """The pass logged the failure and reported none: its book left the index for the tick and waited for
    reconcile's round (9 runs of 60 books)."""
    awaiting_workers(rt)
    failed = failing_once(rt, monkeypatch, "b07")
    assert sorted(tick(rt)) == BOOKS
    run_control(rt)
    monkeypatch.undo()
    assert failed == ["b07"] and due(rt) == set(BOOKS)
    # Due by the passes' clock: a tick's clock measured again under load may read a few ms behind it.
    rt.redis.client.zadd(rt.redis.keys.due(), dict.fromkeys(BOOKS, 0))
    rt.redis.recovered_at = float("-inf")  # the workers are back
    advertise(rt, "gpu.audio")
    tick(rt)
    run_control(rt)
    assert all(generating(rt, book) for book in BOOKS)


def test_a_due_write_that_fails_after_a_paged_pass_leaves_the_book_due(rt: Wiring, monkeypatch) -> None:
    """The same for a book passed page by page (reconcile's pass here, which dispatches nothing)."""
    monkeypatch.setattr(page, "PAGE", 1)
    awaiting_workers(rt)
    rt.redis.client.delete(rt.redis.keys.due())
    failing_once(rt, monkeypatch, "b03")
    gate.gate_batch(rt.ports, ["b03"], dispatch_work=False)
    assert due(rt) == {"b03"}


def due_at(rt: Wiring) -> dict[str, float]:
    return {str(b): s for b, s in rt.redis.client.zrange(rt.redis.keys.due(), 0, -1, withscores=True)}


def leased(rt: Wiring) -> dict[str, float]:
    return {str(b): s for b, s in rt.redis.client.zrange(rt.redis.keys.due_leases(), 0, -1, withscores=True)}


def lose_control_queue(rt: Wiring) -> None:
    """The batches on the control queue are lost (a control worker killed holding them: acknowledged on receipt)."""
    redis.Redis.from_url(rt.settings.broker_url).delete(CONTROL_QUEUE)


def test_a_gate_batch_lost_on_its_way_is_sent_again_once_its_lease_runs_out(rt: Wiring) -> None:
    """The tick took the due books off the index; a control worker killed holding their batch left them off it,
    until reconcile's round came to each: minutes at scale. Now the tick leases them (`ANIMASTOR_RECONCILE_SECONDS`,
    kept apart from the due index) and sends them again when the lease runs out."""
    awaiting_workers(rt)
    rt.redis.recovered_at = float("-inf")  # the workers are back
    advertise(rt, "gpu.audio")
    before = rt.ports.clock()
    assert sorted(tick(rt)) == BOOKS
    lose_control_queue(rt)
    assert tick(rt) == []  # asked for once while its lease runs
    ends = leased(rt)
    assert sorted(ends) == BOOKS and min(ends.values()) >= before + rt.settings.reconcile_seconds - 1
    rt.redis.client.zadd(rt.redis.keys.due_leases(), dict.fromkeys(BOOKS, before - 1))  # the leases ran out
    assert sorted(tick(rt)) == BOOKS
    run_control(rt)
    assert all(generating(rt, book) for book in BOOKS)
    assert leased(rt) == {}


def test_a_leased_book_s_pass_leaves_no_lease_and_writes_its_own_due_time(rt: Wiring) -> None:
    """A book with nothing waiting costs the tick nothing once its pass ran (its lease gone with it); one waiting
    for a deferral longer than the lease is due when that ends."""
    lane(rt, lane_limit=1)
    for book in ("runs", "waits"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    for book in ("runs", "waits"):
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert running(rt, "runs", "waits") == {"runs": 1}
    waits_due = due_at(rt)["waits"]  # its capacity deferral's end (60 s), beyond the tick's lease (30 s)
    rt.ports.book_state.set_due_all(["runs", "waits"], rt.ports.clock() - 1)  # both asked for (a job's end, say)
    before = rt.ports.clock()
    assert sorted(tick(rt)) == ["runs", "waits"]
    assert due_at(rt) == {}  # off the index, leased
    assert set(leased(rt)) == {"runs", "waits"}
    assert min(leased(rt).values()) >= before + rt.settings.reconcile_seconds - 1  # a clock measured anew: a second
    run_control(rt)
    assert leased(rt) == {}
    after = due_at(rt)
    assert "runs" not in after  # nothing waits: off the index
    assert after["waits"] == pytest.approx(waits_due, abs=2.0)
    assert tick(rt) == []


def test_a_regenerate_during_a_leased_pass_keeps_its_due_time(rt: Wiring, monkeypatch) -> None:
    """A review of a lease kept in the due index itself: a regenerate running during a leased pass wrote a later due
    time (its capacity deferral's end), dropped behind the lease; the pass, on facts read before the regenerate,
    then cleared the lease: the book had pending pairs and no due entry."""
    lane(rt, lane_limit=1)
    rt.catalog.import_book(make_book("other", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "other", ["audio"])
    assert running(rt, "other") == {"other": 1}  # holds the lane's only slot
    rt.ports.book_state.set_due("b", rt.ports.clock() - 1)  # b asked for a pass (a job's end, say)
    assert tick(rt) == ["b"]
    lose_control_queue(rt)  # its batch is run by hand below
    real = gate._read_facts

    def facts_then_regenerate(ports: Ports, books: Sequence[str]) -> dict[str, gate.Facts]:
        facts = real(ports, books)
        regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # another control process, after the batch's read
        return facts

    monkeypatch.setattr(gate, "_read_facts", facts_then_regenerate)
    gate.gate_batch(rt.ports, ["b"])
    assert "pending" in states(rt, "b").values()
    assert due_at(rt)["b"] > rt.ports.clock()  # at its deferral's end
    assert leased(rt) == {}


def test_a_due_now_written_during_a_leased_pass_stands(rt: Wiring, monkeypatch) -> None:
    """Someone asked for the book's pass now after the batch read its rows: the pass's later time leaves it."""
    lane(rt, lane_limit=1)
    rt.catalog.import_book(make_book("other", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "other", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # lane full: deferred 60 s
    rt.ports.book_state.set_due("b", rt.ports.clock() - 1)
    assert tick(rt) == ["b"]
    lose_control_queue(rt)
    real = rt.ports.assets.gate_rows_many

    def rows_then_someone_asks(books: Sequence[str], **kw: Any) -> Any:
        rows = real(books, **kw)
        rt.ports.book_state.set_due("b", rt.ports.clock())  # another process: "pass b now" (after these rows)
        return rows

    monkeypatch.setattr(rt.ports.assets, "gate_rows_many", rows_then_someone_asks)
    gate.gate_batch(rt.ports, ["b"])
    assert due_at(rt)["b"] <= rt.ports.clock()
    assert leased(rt) == {}
