"""Counters and duration histograms the flows leave for the metrics exporter.

They live in one Redis hash so every worker process adds to the same totals and the
exporter (`animastor-tasks metrics`) reads them with one HGETALL. Losing them in a Redis
restart only resets counters, which Prometheus handles as a counter reset. Updates are
best effort: a lost one never fails the work that made it.

Names carry their labels after a colon: `job:<event>:<stage>`, `dispatch:<outcome>`, and histograms
`<name>:<stage>` (`job_seconds:audio`), which the exporter turns into a `stage` label.
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
#: Bounds of the GPU-side histograms (a job or its wait in the queue takes seconds to half an hour).
JOB_BUCKETS: tuple[float, ...] = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: Histograms (name before any `:<stage>`) that use `JOB_BUCKETS`.
LONG_HISTOGRAMS = frozenset({"job_seconds", "queue_wait_seconds"})


def buckets_for(name: str) -> tuple[float, ...]:
    """The bucket bounds of histogram `name` (`job_seconds:audio` uses those of `job_seconds`)."""
    return JOB_BUCKETS if name.partition(":")[0] in LONG_HISTOGRAMS else DURATION_BUCKETS


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
        bound = next((f"{b:g}" for b in buckets_for(name) if seconds <= b), "+Inf")
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

    def observe_since_dispatch(self, name: str, dispatch_id: str) -> None:
        """Observe the time since the dispatch was published (`dispatched_at` of its lease metadata, written
        by `LeaseStore.take_leases`): a job's wait in its queue. Nothing when the metadata is gone.

        The clock of the dispatching control worker against this one's: keep hosts on NTP.
        """
        try:
            raw = self.conn.client.hget(self.conn.keys.dispatch(dispatch_id), "dispatched_at")
        except redis.RedisError as err:
            log.debug("[METRICS] dispatch time of %s unreadable: %s", dispatch_id, err)
            return
        try:
            at = float(raw) if raw is not None else None
        except ValueError:
            at = None
        if at:
            self.observe(name, max(0.0, time.time() - at))

    def read(self) -> dict[str, str]:
        """Every counter and histogram field (for the exporter); `StoreUnavailable` when Redis is down."""
        raw = self.conn.run(lambda: self.conn.client.hgetall(self.conn.keys.metrics()))
        return {str(k): str(v) for k, v in raw.items()}
