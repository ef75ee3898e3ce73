"""The queued-liveness rule: which lease-less dispatches still wait in their queue."""

from __future__ import annotations

from animastor_tasks.domain.liveness import Dispatched, queued_lease_ttl, still_queued


def d(dispatch_id: str, at: float | None, queue: str = "gpu.image") -> Dispatched:
    return Dispatched(dispatch_id, queue, at)


def test_a_listing_broker_is_believed_exactly() -> None:
    dispatches = [d("a", 1.0), d("b", 2.0), d("c", None)]
    assert still_queued(dispatches, {"b", "c", "zz"}, {"gpu.image": 99}) == {"b", "c"}


def test_no_evidence_keeps_nothing_alive() -> None:
    assert still_queued([d("a", 1.0)], None, None) == set()


def test_a_queue_holding_every_undelivered_job_keeps_them_all() -> None:
    dispatches = [d("a", 1.0), d("b", 2.0), d("c", 3.0)]
    assert still_queued(dispatches, None, {"gpu.image": 3}) == {"a", "b", "c"}
    # Messages of superseded dispatches count too: more than enough is enough.
    assert still_queued(dispatches, None, {"gpu.image": 7}) == {"a", "b", "c"}


def test_a_short_queue_holds_the_newest_ones() -> None:
    dispatches = [d("c", 3.0), d("a", 1.0), d("b", 2.0)]
    assert still_queued(dispatches, None, {"gpu.image": 2}) == {"b", "c"}
    assert still_queued(dispatches, None, {"gpu.image": 0}) == set()
    assert still_queued(dispatches, None, {}) == set()


def test_a_delivered_job_is_never_counted_and_queues_are_counted_apart() -> None:
    dispatches = [d("ran", None), d("a", 1.0), d("x", 1.0, "gpu.audio"), d("y", 2.0, "gpu.audio")]
    assert still_queued(dispatches, None, {"gpu.image": 5, "gpu.audio": 1}) == {"a", "y"}


def test_the_kept_lease_outlives_a_late_pass() -> None:
    assert queued_lease_ttl(3, 2) == 7
    assert queued_lease_ttl(120, 30) > 120 + 30
