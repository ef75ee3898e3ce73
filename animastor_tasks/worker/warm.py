"""Connections opened, and the job path's reads made once, before a process's first task, not by it.

A fresh pool child (and a solo worker) opens its Postgres, broker and result-backend connections
lazily; its first job paid for them between its dispatch and its start, and every child of a worker
deployed or restarted paid at once (measured: the first eight jobs of an 8-process worker started
48-106 ms after their dispatch, the next ones about 16 ms). With the connections open, a child's first
job and first refill still paid for first use: the database server loading its caches for our tables,
the client its type adapters, Python the generator's modules (measured on the 8-process lone-book
benchmark: start 37-59 ms instead of 3-4, refill 32-93 ms instead of 8-22). The warm-up makes those
reads on a book id no book can have, so it changes nothing. It runs in a thread, so a store that is
down at start delays no task and fails nothing: the first task then connects, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery import Celery

from animastor_tasks.ports import Ports
from animastor_tasks.worker import wiring

log = logging.getLogger("animastor.worker")

# A control character: `domain.book.validate_id` refuses it in any id, so no real book has this one.
NO_BOOK = "\x01warm-up"


def warm_up(app: Celery) -> threading.Thread:
    """Open this process's connections in the background; the thread is returned for tests to join."""
    current = wiring.current()  # built here, not in the thread: one wiring per process
    thread = threading.Thread(target=_warm, args=(app, current.db.ping, current.ports), name="warm-up", daemon=True)
    thread.start()
    return thread


def _warm(app: Celery, ping_postgres: Callable[[], None], ports: Ports) -> None:
    steps: list[tuple[str, Callable[[], Any]]] = [
        # The Redis dataset remembered from the start, so a later FLUSHALL or empty restart is noticed
        # (`BookStateStore._seen_epoch`) even by a process that has run no gate pass yet.
        ("redis", ports.book_state.presence_unsure_since),
        ("postgres", ping_postgres),
        ("broker", lambda: _broker(app)),
        ("result backend", lambda: _result_backend(app)),
        ("job path", lambda: job_path_reads(ports)),
        ("generators", lambda: _generators(ports)),
    ]
    for name, step in steps:
        try:
            step()
        except Exception as err:  # the first task connects instead, and reports the store's error itself
            log.warning("[WORKER] warm-up: %s not reachable yet: %s", name, err)


def job_path_reads(ports: Ports) -> None:
    """Once each, on `NO_BOOK`: the reads of a job's start, of a refill and of its claim's count. Nothing is
    written: the delivery finds no lease, so it renews none and takes no running marker."""
    registry = ports.settings.registry
    stages = [spec.name for spec in registry.stages]
    pair = ("warm-up", "warm-up", stages[0])
    with ports.jobs.starting(NO_BOOK, pair):
        pass
    ports.assets.gate_candidates(NO_BOOK, stages, 1)
    ports.assets.lane_load(stages)
    ports.book_state.pair_snapshot(NO_BOOK, [pair], ports.clock(), registry.queues())  # measures the clock too
    ports.leases.start_delivery((NO_BOOK, *pair), "warm-up", "warm-up", 1)  # the job start's Redis step


def _generators(ports: Ports) -> None:
    """Each stage's generator built once (its modules imported). One that cannot be built is left to the
    job, which fails its pair with the reason; a worker need not serve every stage."""
    for spec in ports.settings.registry.stages:
        try:
            ports.generators.load(spec)
        except Exception as err:
            log.debug("[WORKER] warm-up: generator of %s not built: %s", spec.name, err)


def _broker(app: Celery) -> None:
    """The producer connection the jobs' refills publish through (kept in the app's producer pool)."""
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection(max_retries=1)


def _result_backend(app: Celery) -> None:
    client = getattr(app.backend, "client", None)  # the Redis result backend; others connect on first use
    if client is not None:
        client.ping()
