"""The broker side: publishing jobs, revoking them, and counting live consumers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

from animastor_tasks.adapters.redis.coordination import Coordination
from animastor_tasks.errors import StoreUnavailable

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


def queued_dispatch_ids(broker_url: str, queues: Sequence[str], limit: int = 10_000) -> set[str] | None:
    """Task ids of the messages waiting in Redis-broker queues: live evidence for a queued job.

    A job that waits in its queue longer than its lease TTL has not started renewing its
    lease yet; without this, reconcile would re-dispatch it. None where the broker cannot be
    peeked at (AMQP), so callers fall back to leases alone.
    """
    import json

    import redis

    parts = urlsplit(broker_url)
    if parts.scheme in ("redis", "rediss"):
        client = redis.Redis.from_url(broker_url, socket_timeout=5)
    elif parts.scheme == "redis+socket":
        client = redis.Redis(unix_socket_path=parts.path, socket_timeout=5)
    else:
        return None
    ids: set[str] = set()
    try:
        pipe = client.pipeline(transaction=False)
        for queue in queues:
            pipe.lrange(queue, 0, limit - 1)
        for messages in pipe.execute():
            for raw in messages:
                try:
                    task_id = json.loads(raw)["headers"]["id"]
                except (ValueError, KeyError, TypeError):
                    continue
                ids.add(str(task_id))
    except redis.RedisError as err:
        raise StoreUnavailable("broker", broker_url, str(err)) from err
    finally:
        client.close()
    return ids
