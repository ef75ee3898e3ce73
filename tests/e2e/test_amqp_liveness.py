"""RabbitMQ on one host, issue 18: a worker's remote-control (pidbox) queue can be taken up again by a new
connection while the old one still holds it, and remote control (what Flower's inspect uses) still answers.

Why: a worker that reconnects after a partition, while the broker still holds its old half-open connection,
declares its pidbox queue again; an exclusive one is locked by the old connection (RESOURCE_LOCKED, 405) and
the worker dies (celery#1963). The cluster suite cuts real links (tests/cluster/test_network.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.amqp]


def test_the_pidbox_queue_is_not_locked_to_one_connection(
    make_stack: Callable[..., Any], figure: Callable[[str], None], amqp_broker: Any
) -> None:
    from kombu import Connection

    stack = make_stack(broker_url=amqp_broker.url)
    worker = stack.cluster.gpu("image")
    assert worker.hostname
    pong = stack.cluster.run(["inspect", "ping", "-d", worker.hostname, "--timeout", "5"], timeout=30)
    assert "pong" in pong.stdout, pong.stdout + pong.stderr

    # Another connection (the worker's own, once it reconnects) may declare the queue while this one holds it.
    with Connection(amqp_broker.url, connect_timeout=3) as conn:
        channel = conn.channel()
        try:
            name, _, consumers = channel.queue_declare(queue=f"{worker.hostname}.celery.pidbox", passive=True)
        finally:
            channel.close()
    assert consumers == 1
    active = stack.cluster.run(["inspect", "active", "-d", worker.hostname, "--timeout", "5"], timeout=30)
    assert "empty" in active.stdout or "[]" in active.stdout, active.stdout + active.stderr
    figure(f"amqp: pidbox queue {name} shared by a second connection; inspect ping and active answer")
