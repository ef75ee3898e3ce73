"""Counters and duration histograms the flows leave for the metrics exporter.

They live in one Redis hash so every worker process adds to the same totals and the
exporter (`animastor-tasks metrics`) reads them with one HGETALL. Losing them in a Redis
restart only resets counters, which Prometheus handles as a counter reset. Updates are
best effort: a lost one never fails the work that made it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import redis

from animastor_tasks.adapters.redis.connection import RedisConnection

log = logging.getLogger("animastor.telemetry")

#: Upper bounds (seconds) of the duration histograms; everything above the last lands in "+Inf".
DURATION_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def histogram_field(name: str, part: str) -> str:
    """The counters-hash field of one histogram part: `le=<bound>`, `count`, `sum_us` or `last`."""
    return f"hist:{name}:{part}"


class CounterStore:
    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn

    def add(self, counts: Mapping[str, int]) -> None:
        if not any(counts.values()):
            return
        try:
            pipe = self.conn.client.pipeline(transaction=False)
            for name, n in counts.items():
                if n:
                    pipe.hincrby(self.conn.keys.metrics(), name, n)
            pipe.execute()
        except redis.RedisError as err:
            log.debug("[METRICS] counter update lost: %s", err)

    def observe(self, name: str, seconds: float) -> None:
        """Add one duration to the histogram `name` (one pipeline: its bucket, count, sum and time of last).

        Buckets are stored non-cumulative and the sum in whole microseconds (HINCRBY stays an
        integer); the exporter accumulates them (`operator/metrics.py`).
        """
        bound = next((f"{b:g}" for b in DURATION_BUCKETS if seconds <= b), "+Inf")
        key = self.conn.keys.metrics()
        try:
            pipe = self.conn.client.pipeline(transaction=False)
            pipe.hincrby(key, histogram_field(name, f"le={bound}"), 1)
            pipe.hincrby(key, histogram_field(name, "count"), 1)
            pipe.hincrby(key, histogram_field(name, "sum_us"), max(0, round(seconds * 1_000_000)))
            pipe.hset(key, histogram_field(name, "last"), f"{time.time():.3f}")
            pipe.execute()
        except redis.RedisError as err:
            log.debug("[METRICS] observation of %s lost: %s", name, err)

    def read(self) -> dict[str, str]:
        """Every counter and histogram field (for the exporter); `StoreUnavailable` when Redis is down."""
        raw = self.conn.run(lambda: self.conn.client.hgetall(self.conn.keys.metrics()))
        return {str(k): str(v) for k, v in raw.items()}
