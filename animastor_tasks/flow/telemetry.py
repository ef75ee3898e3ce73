"""Counters the flows leave in Redis for the metrics exporter (Flower cannot show them).

Counters live in one Redis hash so every worker process adds to the same totals and
the exporter (`animastor-tasks metrics`) reads them with one HGETALL. Losing them in a
Redis restart only resets counters, which Prometheus handles as a counter reset.
"""

from __future__ import annotations

import logging
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
