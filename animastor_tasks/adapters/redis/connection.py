"""One process's Redis connection: the client, the keyspace and the Lua scripts.

The role stores in this package share it. Driver errors become `StoreUnavailable` here,
at the edge, so no caller sees a redis traceback.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from typing import TypeVar

import redis
from redis.client import Pipeline

from animastor_tasks.domain.keys import Keyspace
from animastor_tasks.errors import ConfigError, StoreUnavailable, redact_url

T = TypeVar("T")
CLOCK_CHECK_SECONDS = 60.0  # how often a process measures its clock's offset to the server's (`server_time`)
CLOCK_JUMP_SECONDS = 1.0  # this host's wall clock moved so much away from its monotonic clock: measured again
OUT_OF_MEMORY = "Redis is full: its maxmemory reached with nothing it may evict; see docs/deployment.md, 'Redis memory'"


def _script(name: str) -> str:
    return (resources.files("animastor_tasks.adapters.redis") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def eviction_policy(url: str, *, within: float) -> str | None:
    """The `maxmemory-policy` of the Redis at `url`; None when it does not say in time (down, or a managed Redis that
    refuses CONFIG)."""
    try:
        client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=within, socket_connect_timeout=within)
        with client:
            return client.config_get("maxmemory-policy").get("maxmemory-policy") or None
    except (redis.RedisError, OSError, ValueError, TypeError):
        return None


class RedisConnection:
    def __init__(self, url: str, keys: Keyspace, *, socket_timeout: float = 5.0) -> None:
        self.url = url
        self.keys = keys
        try:
            self.client: redis.Redis = redis.Redis.from_url(
                url, decode_responses=True, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
            )
            # An option it does not know (`?sockettimeout=5`) is handed to each connection, which refuses it with a
            # TypeError: a traceback from every command, and a Redis that was fine reported down by the exporter.
            pool = self.client.connection_pool
            pool.connection_class(**pool.connection_kwargs)  # connects nowhere
        except (TypeError, ValueError) as err:  # one it cannot read (`?socket_timeout=abc`): at start, not at each call
            raise ConfigError(f"ANIMASTOR_REDIS_URL={redact_url(url)!r}: {err}") from None
        self.renew_script = self.client.register_script(_script("renew_lease"))
        self.restore_script = self.client.register_script(_script("restore_lease"))
        self.supersede_script = self.client.register_script(_script("supersede"))
        self.withdraw_consumer_script = self.client.register_script(_script("withdraw_consumer"))
        self.release_lua = _script("release_lease")
        self.breaker_acquire_script = self.client.register_script(_script("breaker_acquire"))
        self.breaker_record_script = self.client.register_script(_script("breaker_record"))
        self.breaker_release_script = self.client.register_script(_script("breaker_release"))
        self.start_delivery_script = self.client.register_script(_script("start_delivery"))
        self.abandon_delivery_script = self.client.register_script(_script("abandon_delivery"))
        self.retake_lease_script = self.client.register_script(_script("retake_lease"))
        self._batch = threading.local()  # this thread's open `batched` pipeline, if any
        # When Redis answered again after this process could not reach it: what lapses with time (the workers'
        # heartbeats) may have lapsed meanwhile only because they could not reach it either.
        self.recovered_at = float("-inf")
        self._unreachable = False
        self._server_minus_monotonic: float | None = None  # `server_time`: unknown until measured
        self._clock_checked = float("-inf")
        self._wall_minus_monotonic = time.time() - time.monotonic()

    @contextmanager
    def errors(self) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as err:
            if isinstance(err, redis.ConnectionError | redis.TimeoutError):
                self._unreachable = True
            detail = str(err) or type(err).__name__
            if isinstance(err, redis.exceptions.OutOfMemoryError):  # read as a plain outage, an operator looked for one
                detail += f" ({OUT_OF_MEMORY})"
            raise StoreUnavailable("redis", self.url, detail) from err
        if self._unreachable:
            self._unreachable = False
            self._clock_checked = float("-inf")  # measured again now: it may never have been
            self.recovered_at = self.server_time()

    def run(self, fn: Callable[[], T]) -> T:
        with self.errors():
            return fn()

    @contextmanager
    def batched(self) -> Iterator[None]:
        """The writes this thread makes through `writes` in the block reach the server in one round trip when
        it ends, and none of them when it raises. Nested, the outermost batch sends them."""
        if getattr(self._batch, "pipe", None) is not None:
            yield
            return
        pipe = self.client.pipeline(transaction=False)
        self._batch.pipe = pipe
        try:
            yield
        finally:
            self._batch.pipe = None
        with self.errors():
            pipe.execute()

    @contextmanager
    def writes(self) -> Iterator[Pipeline]:
        """A pipeline to write through: the open batch's, or one of its own, sent when the block ends."""
        pipe = getattr(self._batch, "pipe", None)
        if pipe is not None:
            yield pipe
            return
        with self.errors():
            own = self.client.pipeline(transaction=False)
            yield own
            own.execute()

    def server_time(self, *, fresh: bool = False) -> float:
        """Now by the Redis server's clock: what every time other hosts read is written and judged by (heartbeats,
        deferrals, breakers), so that a host whose clock is off neither reads as gone (its stage BLOCKED) nor
        lingers once dead. Measured (one TIME round trip) at first use and once a minute after, and carried on
        by this host's monotonic clock in between, so a step of its wall clock (NTP) moves nothing; measured
        again at once when the two clocks drift apart: the monotonic one does not count a suspend, and the host's
        beats were dated that long in the past. `fresh`: measured now (Redis reachable), for a beat and for a
        judgement of beats: a step of the Redis host's clock reaches each process at its own next measure, and
        a process that had measured since took the beats of one that had not for stale. A Redis that cannot be
        reached leaves the last measure in use; before any, this host's clock. Never raises."""
        wall_minus_monotonic = time.time() - time.monotonic()
        if abs(wall_minus_monotonic - self._wall_minus_monotonic) > CLOCK_JUMP_SECONDS:
            self._wall_minus_monotonic = wall_minus_monotonic
            self._clock_checked = float("-inf")
        if (fresh and not self._unreachable) or time.monotonic() >= self._clock_checked + CLOCK_CHECK_SECONDS:
            self._clock_checked = time.monotonic()
            try:
                before = time.monotonic()
                seconds, micros = self.client.time()
                after = time.monotonic()
            except redis.RedisError:
                self._clock_checked -= CLOCK_CHECK_SECONDS - 1.0  # asked again in a second
            else:
                self._server_minus_monotonic = seconds + micros / 1e6 - (before + after) / 2
        return self.server_time_as_known()

    def server_time_as_known(self) -> float:
        """`server_time` from the last measure, with no round trip: for a caller that must not wait on Redis."""
        if self._server_minus_monotonic is None:
            return time.time()
        return self._server_minus_monotonic + time.monotonic()

    def ping(self) -> None:
        self.run(self.client.ping)

    def close(self) -> None:
        self.client.close()
