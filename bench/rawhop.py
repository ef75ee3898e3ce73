"""A bare Celery hop for the latency baseline: its own tiny app on the bench broker, queue `bench.raw`.

Worker: `celery -A bench.rawhop worker -Q bench.raw -P solo -c 1`. The no-op task pushes
`time.time()` at its start onto a Redis list named by the caller's token; the caller
BLPOPs it and compares with its own send time (same machine, same clock).

`product_app` is the same hop with the delivery settings animastor's app uses (task
events on, `task-sent` events, `task_track_started`, a Redis result backend), queue
`bench.raw.product`: it separates what Celery settings cost from what orchestration costs.
Worker: `celery -A bench.rawhop:product_app worker -Q bench.raw.product -P solo -c 1`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

QUEUE = "bench.raw"
TASK = "bench.rawhop.noop"
PRODUCT_QUEUE = "bench.raw.product"
PRODUCT_TASK = "bench.rawhop.noop_product"
BROKER = os.environ.get("ANIMASTOR_BROKER_URL", "redis://127.0.0.1:6379/13")
PREFIX = os.environ.get("ANIMASTOR_KEY_PREFIX", "bench")


def bench_app(name: str, queue: str, backend: str | None = None, **conf: Any) -> Celery:
    """A bench-only app on the bench broker: JSON only, prefetch 1, `queue` by default, `conf` on top. Never
    the process's current app: importing a benchmark leaves animastor's own app alone."""
    celery_app = Celery(name, broker=BROKER, backend=backend, set_as_current=False)
    celery_app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        result_accept_content=["json"],
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        **conf,
    )
    return celery_app


app = bench_app("bench_rawhop", QUEUE, task_ignore_result=True)

product_app = bench_app(
    "bench_rawhop_product",
    PRODUCT_QUEUE,
    os.environ.get("ANIMASTOR_REDIS_URL", BROKER),
    task_acks_late=False,
    task_track_started=True,
    worker_send_task_events=True,
    task_send_sent_event=True,
    result_expires=3600,
)

_client: redis.Redis | None = None


def result_key(token: str) -> str:
    return f"{PREFIX}:rawhop:{token}"


def _record(token: str) -> None:
    started = time.time()
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ.get("ANIMASTOR_REDIS_URL", BROKER))
    pipe = _client.pipeline(transaction=False)
    pipe.rpush(result_key(token), repr(started))
    pipe.expire(result_key(token), 60)
    pipe.execute()


@app.task(name=TASK, ignore_result=True)
def noop(token: str) -> None:
    """Record when the task started, nothing else."""
    _record(token)


@product_app.task(name=PRODUCT_TASK)
def noop_product(token: str) -> None:
    """The same, under animastor's delivery settings (its result is stored, like a control task's)."""
    _record(token)
