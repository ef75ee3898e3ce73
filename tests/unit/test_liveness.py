"""The queued-liveness rule: which lease-less dispatches still wait in their queue."""

from __future__ import annotations

from animastor_tasks.domain.liveness import (
    UNDELIVERED_MARKER_SECONDS,
    Dispatched,
    lost_in_queue,
    queued_lease_ttl,
    silent_nodes,
    still_queued,
)


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


def test_a_queued_lease_lives_as_long_as_the_undelivered_marker() -> None:
    """A job waiting in its queue keeps its lease however long the backlog (issue 18): it lapses only
    with the marker, and a lost message gives it up through reconcile, never by waiting."""
    assert queued_lease_ttl() == UNDELIVERED_MARKER_SECONDS


def test_undelivered_jobs_the_broker_no_longer_holds_are_lost() -> None:
    assert lost_in_queue({"a", "b", "c"}, {"b", "c", "zz"}) == {"a"}
    assert lost_in_queue(set(), {"b"}) == set()


def test_a_node_is_silent_once_its_last_heartbeat_is_older_than_the_setting() -> None:
    beats = {"live": 99.0, "almost": 70.5, "edge": 70.0, "gone": 69.9}
    assert silent_nodes(beats, 100.0, 30.0) == {"gone"}  # "edge" is exactly 30 s old: not past it
    assert silent_nodes(beats, 200.0, 30.0) == set(beats)
    assert silent_nodes({}, 100.0, 30.0) == set()
