"""Counters the flows leave in Redis for the metrics exporter (Flower cannot show them).

Counters live in one Redis hash so every worker process adds to the same totals and
the exporter (`animastor-tasks metrics`) reads them with one HGETALL. Losing them in a
Redis restart only resets counters, which Prometheus handles as a counter reset.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import redis

from animastor_tasks.flow.runtime import Runtime

log = logging.getLogger("animastor.telemetry")


def _add(rt: Runtime, counts: Mapping[str, int]) -> None:
    if not counts:
        return
    try:
        pipe = rt.coord.client.pipeline(transaction=False)
        for field, n in counts.items():
            if n:
                pipe.hincrby(rt.coord.keys.metrics(), field, n)
        pipe.execute()
    except redis.RedisError as err:  # counters are best effort; the work itself is not
        log.debug("[METRICS] counter update lost: %s", err)


def record_outcomes(rt: Runtime, outcomes: Mapping[str, int]) -> None:
    """A deferred pair must cost no write, so deferrals are not counted here (the exporter reads the
    deferral sets themselves)."""
    _add(rt, {f"dispatch:{outcome}": n for outcome, n in outcomes.items() if outcome != "deferred_capacity"})


def record_blocked(rt: Runtime, stage: str, commands: int) -> None:
    _add(rt, {f"blocked:{stage}": commands})


def record(rt: Runtime, name: str, n: int = 1) -> None:
    _add(rt, {name: n})


#: Upper bounds (seconds) of the duration histograms; everything above the last lands in "+Inf".
DURATION_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def histogram_field(name: str, part: str) -> str:
    """The counters-hash field of one histogram part: `le=<bound>`, `count`, `sum_us` or `last`."""
    return f"hist:{name}:{part}"


def observe(rt: Runtime, name: str, seconds: float) -> None:
    """Add one duration to the histogram `name` (one pipeline: its bucket, count, sum and time of last).

    Why in the counters hash: the flows run in many worker processes and the exporter must see one
    total. Buckets are stored non-cumulative and the sum in whole microseconds (HINCRBY stays an
    integer); the exporter accumulates them (`animastor_tasks.operator.metrics`).
    """
    bound = next((f"{b:g}" for b in DURATION_BUCKETS if seconds <= b), "+Inf")
    key = rt.coord.keys.metrics()
    try:
        pipe = rt.coord.client.pipeline(transaction=False)
        pipe.hincrby(key, histogram_field(name, f"le={bound}"), 1)
        pipe.hincrby(key, histogram_field(name, "count"), 1)
        pipe.hincrby(key, histogram_field(name, "sum_us"), max(0, round(seconds * 1_000_000)))
        pipe.hset(key, histogram_field(name, "last"), f"{time.time():.3f}")
        pipe.execute()
    except redis.RedisError as err:  # best effort, like the counters
        log.debug("[METRICS] observation of %s lost: %s", name, err)
