"""A job is kept for the process whose slot freed only when nothing waits in its queue (`worker/chain.py`):
the check asks the real broker, Redis (a missing list is an empty queue) and RabbitMQ (a passive declare)."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict

import pytest
from celery import Celery
from kombu import Connection, Producer

from animastor_tasks.flow.job import Job
from animastor_tasks.worker.chain import KeepingPublisher

pytestmark = pytest.mark.e2e


class Published:
    """The publisher the keeper falls back to: records what it was asked to send."""

    def __init__(self) -> None:
        self.jobs: list[str] = []

    def publish_job(self, task_name: str, queue: str, dispatch_id: str, kwargs: dict[str, object]) -> None:
        self.jobs.append(dispatch_id)


def kwargs(dispatch_id: str) -> dict[str, object]:
    """A job's kwargs as dispatch sends them."""
    return asdict(Job("b", "c", "s", "audio", dispatch_id, 1))


def check(url: str) -> None:
    queue = f"chain-check-{uuid.uuid4().hex[:8]}"
    app = Celery(broker=url)
    with Connection(url, connect_timeout=3) as conn:
        channel = conn.channel()
        channel.queue_declare(queue, durable=False, auto_delete=False)
        Producer(channel).publish("waiting", routing_key=queue, exchange="")
    try:
        inner = Published()
        keeper = KeepingPublisher(inner, app, queue, time.monotonic() + 30)  # type: ignore[arg-type]
        keeper.publish_job("animastor.generate.audio", queue, "d1", kwargs("d1"))
        assert keeper.kept is None and inner.jobs == ["d1"]  # a message waits: published behind it
        with Connection(url, connect_timeout=3) as conn:
            conn.channel().queue_purge(queue)
        keeper.publish_job("animastor.generate.audio", queue, "d2", kwargs("d2"))
        assert keeper.kept is not None and keeper.kept.dispatch_id == "d2" and inner.jobs == ["d1"]
        missing = KeepingPublisher(inner, app, f"{queue}-never-declared", time.monotonic() + 30)  # type: ignore[arg-type]
        missing.publish_job("animastor.generate.audio", missing.queue, "d3", kwargs("d3"))
        assert missing.kept is not None  # no such queue: nothing waits in it
        late = KeepingPublisher(inner, app, queue, time.monotonic() + 30)  # type: ignore[arg-type]
        late.publish_job("animastor.generate.audio", queue, "d4", kwargs("d4"))
        assert late.kept is not None  # the pooled connection still works after the broker's 404
    finally:
        with Connection(url, connect_timeout=3) as conn:
            conn.channel().queue_delete(queue)
        app.close()


def test_the_keepers_queue_check_on_redis(private_redis: str) -> None:
    check(private_redis)


def test_the_keepers_queue_check_on_rabbitmq(amqp_broker) -> None:  # type: ignore[no-untyped-def]
    check(amqp_broker.url)
