"""Connections opened before a process's first task, not by it.

A fresh pool child (and a solo worker) opens its Postgres, broker and result-backend connections
lazily; its first job paid for them between its dispatch and its start, and every child of a worker
deployed or restarted paid at once (measured: the first eight jobs of an 8-process worker started
48-106 ms after their dispatch, the next ones about 16 ms). The warm-up runs in a thread, so a store
that is down at start delays no task and fails nothing: the first task then connects, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery import Celery

from animastor_tasks.worker import wiring

log = logging.getLogger("animastor.worker")


def warm_up(app: Celery) -> threading.Thread:
    """Open this process's connections in the background; the thread is returned for tests to join."""
    ping_postgres = wiring.current().db.ping  # built here, not in the thread: one wiring per process
    thread = threading.Thread(target=_warm, args=(app, ping_postgres), name="warm-up", daemon=True)
    thread.start()
    return thread


def _warm(app: Celery, ping_postgres: Callable[[], None]) -> None:
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("postgres", ping_postgres),
        ("broker", lambda: _broker(app)),
        ("result backend", lambda: _result_backend(app)),
    ]
    for name, step in steps:
        try:
            step()
        except Exception as err:  # the first task connects instead, and reports the store's error itself
            log.warning("[WORKER] warm-up: %s not reachable yet: %s", name, err)


def _broker(app: Celery) -> None:
    """The producer connection the jobs' refills publish through (kept in the app's producer pool)."""
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection(max_retries=1)


def _result_backend(app: Celery) -> None:
    client = getattr(app.backend, "client", None)  # the Redis result backend; others connect on first use
    if client is not None:
        client.ping()
