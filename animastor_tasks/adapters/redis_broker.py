"""kombu's Redis transport with one client per channel, not one per message, that rides out a full Redis.

kombu builds a new `redis.Redis` for every message it sends (`Channel._create_client`), and
redis-py fills a fresh table of about 170 reply callbacks for each: about 0.2 ms of CPU per
job message, Flower event and result. Every job sends several, so a GPU worker spent 7% of
its CPU there. A Redis client is thread-safe and holds no connection of its own (it borrows
from the channel's pool), so one per channel and pool does the same work. The pool is
checked on every use: when kombu drops it after a connection error, a new client follows.

Logs and Celery's banner name it `redis://`, as kombu names its `pyamqp` transport `amqp://`.
"""

from __future__ import annotations

from typing import Any

import redis
from kombu import Connection
from kombu.transport import redis as kombu_redis

WRITE_PROBE = "_animastor.write_probe"  # written as a channel opens (kombu prefixes it as its own keys)


class Channel(kombu_redis.Channel):
    _shared_client: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """A channel opens only on a Redis that takes writes: one that is full refuses it as a connection error, which
        Celery retries with its backoff. *Why:* kombu's PING passes on a full Redis, the consumer's first write was
        refused, and Celery restarted it at once, about 12 Redis connections a second left open (review)."""
        super().__init__(*args, **kwargs)
        try:
            self.client.set(WRITE_PROBE, "1", ex=60)
        except redis.exceptions.ResponseError as err:
            if not isinstance(err, redis.exceptions.OutOfMemoryError):
                return  # refused for another reason (an ACL, a replica): proves nothing of memory
            self.close()
            raise
        except redis.exceptions.RedisError:  # the connection lost since the PING: closed as kombu closes it then
            self.close()
            raise

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        client = self._shared_client
        if client is None or client.connection_pool is not pool:
            client = self._shared_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):
    """A Redis out of memory (`maxmemory` reached, nothing it may evict) is a connection error, as kombu takes a Redis
    still loading its data: the worker reconnects, with Celery's retries, until the server takes writes again. *Why:*
    kombu took it for a channel error, Celery for an unrecoverable one, and every worker exited at its next ack, its
    running jobs killed; one started meanwhile exited within a second (Redis memory hunt)."""

    Channel = Channel
    connection_errors = (*kombu_redis.Transport.connection_errors, redis.exceptions.OutOfMemoryError)


Connection.resolve_aliases.setdefault(f"{__name__}:Transport", "redis")
