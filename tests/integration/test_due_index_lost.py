"""A book with commanded work never drops off the due index for longer than a tick or two: only reconcile's round
brought such a book back, and that round is paged (`ANIMASTOR_RECONCILE_PAIRS` per run), minutes at scale.

Real Postgres, Redis and broker; control messages are run through the real tasks (`run_control`). Reconcile passes
five pairs a run here, so that a round takes several runs, as on a big farm.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import gate, page
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, states, use_settings
from .test_elastic_share import lane, run_control

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
