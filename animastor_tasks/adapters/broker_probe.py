"""What the broker itself can tell: consumers per queue (AMQP), the jobs still waiting (Redis) and how
many messages wait per queue (both)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from animastor_tasks.config import redis_py_url
from animastor_tasks.errors import StoreUnavailable

if TYPE_CHECKING:
    from kombu import Connection

log = logging.getLogger("animastor.broker")


def amqp_consumer_counts(url: str, queues: Sequence[str]) -> dict[str, int]:
    """Passive queue declare: the broker's consumer count (0 for a queue that does not exist)."""
    return {queue: consumers for queue, (_, consumers) in amqp_queue_counts(url, queues).items()}


def amqp_queue_counts(url: str, queues: Collection[str]) -> dict[str, tuple[int, int]]:
    """Passive queue declare: (ready messages, consumers) per queue, (0, 0) for one that does not exist.

    A broker that cannot answer raises `StoreUnavailable`, as a store that is down does: a raw
    connection error aborted a whole reconcile pass, and `animastor-tasks queues` with a traceback."""
    try:
        return _amqp_declare(url, queues)
    except Exception as err:
        raise StoreUnavailable("broker", url, str(err).strip() or type(err).__name__) from err


def queue_not_found(err: Exception) -> bool:
    """A passive declare of a queue nobody declared yet (AMQP 404): nothing waits in it, nobody consumes it."""
    return getattr(err, "code", None) == 404 or "NOT_FOUND" in str(err)


#: How long a probe waits for the broker to connect or to answer one request.
PROBE_TIMEOUT_SECONDS = 3


@contextmanager
def probe_connection(url: str) -> Iterator[Connection]:
    """A kombu connection to the broker, connected once, that fails fast: no reconnect per channel (kombu's own
    retried each one after 2 s) and a bound on every read (a broker that takes the connection and never answers
    held an AMQP probe 4 s a queue and a Redis one for ever: a metrics scrape past Prometheus's timeout, every
    series stale during the very outage `animastor_store_up` is for)."""
    from kombu import Connection

    timeouts: dict[str, float] = (
        {"read_timeout": PROBE_TIMEOUT_SECONDS, "write_timeout": PROBE_TIMEOUT_SECONDS}
        if urlsplit(url).scheme in ("amqp", "amqps", "pyamqp")
        else {"socket_timeout": PROBE_TIMEOUT_SECONDS, "socket_connect_timeout": PROBE_TIMEOUT_SECONDS}
    )
    with Connection(url, connect_timeout=PROBE_TIMEOUT_SECONDS, transport_options=timeouts) as conn:
        conn.ensure_connection(max_retries=0)
        yield conn


def _amqp_declare(url: str, queues: Collection[str]) -> dict[str, tuple[int, int]]:
    """(ready messages, consumers) per queue; (0, 0) for a queue that does not exist.

    Any other failure raises (the callers treat it as "the broker cannot tell").
    """
    counts: dict[str, tuple[int, int]] = {}
    with probe_connection(url) as conn:
        for queue in queues:
            channel = conn.channel()
            try:
                _, ready, consumers = channel.queue_declare(queue=queue, passive=True)
                counts[queue] = (int(ready), int(consumers))
            except Exception as err:  # a missing queue closes the channel with 404: nobody consumes it, nothing waits
                if not queue_not_found(err):
                    # Anything else (a broker shutting down, a queue whose node is down) says nothing of its
                    # consumers: taken as none, it BLOCKED a stage whose workers were alive.
                    raise
                log.debug("[PRESENCE] passive declare of %s: no such queue", queue)
                counts[queue] = (0, 0)
            finally:
                try:
                    channel.close()
                except Exception:
                    log.debug("[PRESENCE] channel close failed", exc_info=True)
    return counts


def passive_depths(broker_url: str, queues: Collection[str]) -> dict[str, int | None]:
    """Messages waiting in each queue, asked of either broker (a passive declare); None where it cannot say (`queues`
    shows `?`: an unreadable depth must not read as an empty queue)."""
    depths: dict[str, int | None] = {}
    try:
        with probe_connection(broker_url) as conn:
            for queue in queues:
                try:
                    channel = conn.channel()
                except Exception:
                    depths[queue] = None
                    continue
                try:
                    depths[queue] = int(channel.queue_declare(queue=queue, passive=True).message_count)
                except Exception as err:
                    depths[queue] = 0 if queue_not_found(err) else None  # else unknown
                finally:
                    with suppress(Exception):  # a channel the broker closed (404) may refuse a close
                        channel.close()
    except Exception:
        return dict.fromkeys(queues)
    return depths


class BrokerProbe:
    """The flows' `QueueProbe` for one broker URL."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url

    def queued_dispatch_ids(self, queues: Collection[str]) -> set[str] | None:
        return queued_dispatch_ids(self.broker_url, queues)

    def waiting(self, queue: str) -> int | None:
        return passive_depths(self.broker_url, [queue])[queue]

    def queue_depths(self, queues: Collection[str]) -> dict[str, int] | None:
        """Ready messages per queue on AMQP; None elsewhere (a Redis broker lists its jobs by id instead)."""
        if urlsplit(self.broker_url).scheme not in ("amqp", "amqps", "pyamqp"):
            return None
        # Messages ready (not those a worker holds). An unreachable broker is no evidence (StoreUnavailable):
        # reconcile falls back to leases alone.
        return {queue: ready for queue, (ready, _) in amqp_queue_counts(self.broker_url, queues).items()}


def queued_dispatch_ids(broker_url: str, queues: Collection[str], limit: int = 10_000) -> set[str] | None:
    """Task ids of the messages waiting in Redis-broker queues: live evidence for a queued job.

    A job that waits in its queue longer than its lease TTL has not started renewing its
    lease yet; without this, reconcile would re-dispatch it. None where the broker cannot be
    peeked at (AMQP), so callers fall back to leases alone.
    """
    import json

    import redis

    if urlsplit(broker_url).scheme not in ("redis", "rediss", "redis+socket"):
        return None
    client = redis.Redis.from_url(  # a socket's database as kombu's
        redis_py_url(broker_url), socket_timeout=5, socket_connect_timeout=PROBE_TIMEOUT_SECONDS
    )
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
