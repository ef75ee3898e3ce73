"""A worker that lost its broker rejoins within about a second of the network coming back.

Celery's consumer retries a lost broker connection with kombu's default back-off (2, 4, 6 ... up to 30 s
between tries), so a GPU worker cut off for 30 s came back 12-16 s after the heal, and one cut off for
longer up to 30 s after it. Here every try follows the last by at most `RECONNECT_INTERVAL_MAX`: a try
against an unreachable broker costs one connect timeout, nothing else, so trying often is cheap.
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer

RECONNECT_INTERVAL_MAX = 1.0


class RejoiningConsumer(Consumer):
    """Celery's consumer with a flat reconnect interval (selected by `worker_consumer`)."""

    def ensure_connected(self, conn: Any) -> Any:
        ensure = conn.ensure_connection

        def ensure_quickly(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("interval_start", 0)
            kwargs.setdefault("interval_step", RECONNECT_INTERVAL_MAX)
            kwargs.setdefault("interval_max", RECONNECT_INTERVAL_MAX)
            return ensure(*args, **kwargs)

        conn.ensure_connection = ensure_quickly
        try:
            return super().ensure_connected(conn)
        finally:
            del conn.ensure_connection  # the instance attribute only: kombu's method shows through again
