"""A bare Celery hop for the latency baseline: its own tiny app on the bench broker, queue `bench.raw`.

Worker: `celery -A bench.rawhop worker -Q bench.raw -P solo -c 1`. The no-op task pushes
`time.time()` at its start onto a Redis list named by the caller's token; the caller
BLPOPs it and compares with its own send time (same machine, same clock).
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

QUEUE = "bench.raw"
TASK = "bench.rawhop.noop"
BROKER = os.environ.get("ANIMASTOR_BROKER_URL", "redis://127.0.0.1:6379/13")
PREFIX = os.environ.get("ANIMASTOR_KEY_PREFIX", "bench")

app = Celery("bench_rawhop", broker=BROKER)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_client: redis.Redis | None = None


def result_key(token: str) -> str:
    return f"{PREFIX}:rawhop:{token}"


@app.task(name=TASK, ignore_result=True)
def noop(token: str) -> None:
    """Record when the task started, nothing else."""
    started = time.time()
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ.get("ANIMASTOR_REDIS_URL", BROKER))
    pipe = _client.pipeline(transaction=False)
    pipe.rpush(result_key(token), repr(started))
    pipe.expire(result_key(token), 60)
    pipe.execute()
