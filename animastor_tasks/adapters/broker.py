"""The broker side: publishing jobs, revoking them, and counting live consumers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from animastor_tasks.adapters.redis_store import Coordination

log = logging.getLogger("animastor.broker")


class Publisher(Protocol):
    """What the flows need from Celery; `tasks.CeleryPublisher` is the real one."""

    def publish_job(self, task_name: str, queue: str, dispatch_id: str, kwargs: dict[str, Any]) -> None: ...

    def revoke(self, dispatch_ids: Sequence[str]) -> None: ...

    def enqueue_gate(self, book_id: str) -> None: ...


class ConsumerCounter:
    """Live consumers per queue: worker heartbeats in Redis, and the broker's own count on AMQP.

    On AMQP the broker knows at once when a consumer's connection dies, so its count
    wins when it says zero; heartbeats alone may lag a SIGKILL by one TTL.
    """

    def __init__(self, coord: Coordination, amqp_url: str | None = None) -> None:
        self.coord = coord
        self.amqp_url = amqp_url

    def counts(self, queues: Sequence[str], heartbeats: dict[str, int] | None = None) -> dict[str, int]:
        """`heartbeats`: live heartbeat counts already read (a gate pass reads them in its snapshot)."""
        if heartbeats is None:
            live = self.coord.live_consumers(queues)
            heartbeats = {q: len(live.get(q, {})) for q in queues}
        counts = {q: heartbeats.get(q, 0) for q in queues}
        if self.amqp_url:
            broker_counts = amqp_consumer_counts(self.amqp_url, queues)
            counts = {q: (counts[q] if broker_counts.get(q, 0) > 0 else 0) or broker_counts.get(q, 0) for q in queues}
        return counts


def amqp_consumer_counts(url: str, queues: Sequence[str]) -> dict[str, int]:
    """Passive queue declare: the broker's consumer count (0 for a queue that does not exist)."""
    from kombu import Connection

    counts: dict[str, int] = {}
    with Connection(url, connect_timeout=3) as conn:
        for queue in queues:
            channel = conn.channel()
            try:
                _, _, consumers = channel.queue_declare(queue=queue, passive=True)
                counts[queue] = int(consumers)
            except Exception as err:  # a missing queue closes the channel with 404
                log.debug("[PRESENCE] passive declare of %s failed: %s", queue, err)
                counts[queue] = 0
            finally:
                try:
                    channel.close()
                except Exception:
                    log.debug("[PRESENCE] channel close failed", exc_info=True)
    return counts
