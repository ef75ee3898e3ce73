"""After an AMQP reconnect the new channel's prefetch leaves out the processes that jobs of the lost channel hold
(worker/rejoin.py); e2e: tests/e2e/test_amqp_busy_reconnect.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery.worker import state as worker_state
from kombu.common import QoS

from animastor_tasks.worker.rejoin import RejoiningConsumer

LOST, NEW = object(), object()  # the lost channel and the new one


class _Job:
    """A running acks-late request whose message came on `channel`."""

    def __init__(self, channel: object) -> None:
        self.task = SimpleNamespace(acks_late=True)
        self.acknowledged = False
        self.message = SimpleNamespace(channel=channel)


def _reconnected(processes: int, running: set[Any]) -> Any:
    """A consumer past its connection loss (as `on_connection_error_after_connected` leaves it), new channel made."""
    consumer: Any = RejoiningConsumer.__new__(RejoiningConsumer)
    added: list[str] = []
    consumer.pool = SimpleNamespace(num_processes=processes)
    consumer.prefetch_multiplier = 1
    consumer.app = SimpleNamespace(amqp=SimpleNamespace(queues=SimpleNamespace(consume_from={"gpu.audio": None})))
    consumer.hub = SimpleNamespace(on_tick=set())
    consumer.add_task_queue = added.append
    consumer.added = added
    busy = len(running)
    consumer._following, consumer._counted = True, busy
    consumer.held_back = frozenset({"gpu.audio"}) if busy >= processes else frozenset()
    consumer.qos = QoS(lambda prefetch_count: None, consumer._prefetch_for(busy))
    consumer.task_consumer = SimpleNamespace(channel=NEW, queues=[SimpleNamespace(name="gpu.audio")])
    return consumer


def test_a_worker_whose_only_process_runs_a_job_of_the_lost_channel_consumes_again_when_it_ends(monkeypatch) -> None:
    long_job = _Job(LOST)
    monkeypatch.setattr(worker_state, "active_requests", {long_job})
    consumer = _reconnected(1, {long_job})
    consumer.hold_back()
    assert consumer.task_consumer.queues == [] and consumer.held_back == {"gpu.audio"}
    assert consumer._follow in consumer.hub.on_tick
    consumer._follow()
    assert consumer.added == []  # still running: nothing taken
    worker_state.active_requests.discard(long_job)
    consumer._follow()
    assert consumer.added == ["gpu.audio"] and consumer.held_back == frozenset()
    assert consumer.qos.value == 1 and not consumer.hub.on_tick


@pytest.mark.parametrize("acked_new_job_first", [False, True])
def test_a_process_held_by_a_job_of_the_lost_channel_is_given_back_only_when_that_job_ends(
    monkeypatch, acked_new_job_first: bool
) -> None:
    """Two processes, one running a job of the lost channel: prefetch 1. Celery gave its second slot back on the
    first ack of the new channel, while the old job still ran, so a job was fetched that no process could start."""
    long_job = _Job(LOST)
    monkeypatch.setattr(worker_state, "active_requests", {long_job})
    consumer = _reconnected(2, {long_job})
    consumer.hold_back()
    assert consumer.held_back == frozenset() and consumer.task_consumer.queues  # one process free: it consumes
    assert consumer.qos.value == 1
    if acked_new_job_first:
        new_job = _Job(NEW)
        worker_state.active_requests.add(new_job)
        consumer._follow()
        worker_state.active_requests.discard(new_job)
        consumer._follow()
        assert consumer.qos.value == 1
    worker_state.active_requests.discard(long_job)
    consumer._follow()
    assert consumer.qos.value == 2 and not consumer.hub.on_tick and consumer.added == []
