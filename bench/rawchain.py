"""The busy-fraction ceiling of bare Celery: the same slots and job length, no orchestration.

Its own tiny app on the bench broker, queue `bench.rawchain`, with the delivery settings of
animastor's GPU jobs (prefork `-O fair`, prefetch 1, `acks_late`, task events on, results in Redis).
Each job sleeps as long as a builtin job of the busy benchmarks and, at its end, sends its successor,
as a refill does; it records its start and end on a Redis list. `busy_fraction` over those records,
with the window of `bench.farm.busy_fraction`, is what a dispatcher that cost nothing would reach:
Celery's own hand-off from one job to the next is left in it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from animastor_tasks.dev.celery_commands import celery_argv
from animastor_tasks.dev.supervisor import Supervisor, wait_until
from bench.common import ROOT, bench_env, drop_logs
from bench.farm import Busy, busy_fraction
from bench.rawhop import BROKER, PREFIX, bench_app

QUEUE = "bench.rawchain"
TASK = "bench.rawchain.job"

app = bench_app(
    "bench_rawchain",
    QUEUE,
    os.environ.get("ANIMASTOR_REDIS_URL", BROKER),
    task_acks_late=True,
    worker_send_task_events=True,
    result_expires=3600,
)

_client: redis.Redis | None = None


def _records(token: str) -> str:
    return f"{PREFIX}:rawchain:{token}"


@app.task(name=TASK)
def job(token: str, index: int, total: int, slots: int, seconds: float) -> int:
    """Run `seconds`, send the job `slots` further on (if any), record (start, end)."""
    global _client
    started = time.time()
    time.sleep(seconds)
    ended = time.time()
    if index + slots < total:
        job.apply_async((token, index + slots, total, slots, seconds))
    if _client is None:
        _client = redis.Redis.from_url(os.environ.get("ANIMASTOR_REDIS_URL", BROKER))
    _client.rpush(_records(token), json.dumps([index, started, ended]))
    _client.expire(_records(token), 600)
    return index


def measure(workers: list[int], jobs: int, seconds: float) -> Busy:
    """`jobs` chained jobs of `seconds` on workers of the given process counts (1: the solo pool, as the
    farm starts them); their busy fraction, as `bench.farm.busy_fraction` computes the lanes'."""
    folder = Path(tempfile.mkdtemp(prefix="animastor-bench-rawchain-"))
    sup = Supervisor({**os.environ, **bench_env(), "PYTHONPATH": ROOT}, folder, say=lambda _: None, cwd=Path(ROOT))
    client = redis.Redis.from_url(os.environ.get("ANIMASTOR_REDIS_URL", BROKER))
    token = uuid.uuid4().hex
    try:
        for i, procs in enumerate(workers):
            pool = ("-P", "solo") if procs == 1 else ("-O", "fair")
            argv = ("worker", "-Q", QUEUE, "-c", str(procs), "--prefetch-multiplier", "1", "-n", f"rawchain{i}@%h")
            quiet = ("-l", "warning", "--without-gossip", "--without-mingle")
            sup.start(f"rawchain{i}", celery_argv(*argv, *pool, *quiet, app="bench.rawchain"))
        wait_until(lambda: _consumers(len(workers)), 60, "raw chain workers", sup.check)
        slots = sum(workers)
        sent = time.time()
        for index in range(min(slots, jobs)):
            job.apply_async((token, index, jobs, slots, seconds))
        wait_until(lambda: client.llen(_records(token)) >= jobs, jobs * seconds + 60, "raw chain done", sup.check)
        records = [json.loads(raw) for raw in client.lrange(_records(token), 0, -1)]
    finally:
        client.delete(_records(token))
        client.close()
        sup.stop_all()
    drop_logs(folder)
    rows: list[tuple[str, str, str, str, float]] = [("dispatch", "", "", "", sent)]
    for index, started, ended in records:
        rows += [("job.started", "", "", str(index), started), ("job.ready", "", "", str(index), ended)]
    return busy_fraction(rows, sum(workers))


def _consumers(expected: int) -> bool:
    replies: Any = app.control.ping(timeout=0.5)
    return len(replies or []) >= expected
