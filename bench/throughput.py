"""End-to-end dispatch throughput next to raw Celery through the same broker and worker processes.

Real processes (`bench.farm`): control worker (prefork, 2 processes), beat, two GPU workers of two
processes each (`gpu.audio`, `gpu.image`); near-instant builtin jobs (1 step, no sleep); lane
limit, book quota and window raised to 64. Quick: 10 books x 25 scenes x 2 stages = 500 jobs;
full: 25 books x 40 scenes x 2 stages = 2,000 jobs (plus a second raw run after, averaged).

- `raw_celery_jobs_per_s`: the same number of no-op tasks (Celery's builtin `celery.accumulate`,
  which every worker has) sent to the two GPU queues through animastor's own app configuration
  and consumed by the same GPU worker processes; N / (last result's date_done - first send).
- `dispatch_jobs_per_s`: every book regenerated at once (the client, `wait=False`); N / (last
  job.ready - first send, database clock). Target: at least 80% of the raw figure.
- `control_cpu_ms_per_job`: CPU (user + system, /proc) of the control worker, its pool processes
  and beat over the dispatch run, divided by the jobs; at most 5 ms. Baseline: the same processes'
  CPU over the raw run. A job that ends ready dispatches the next one in its own GPU worker process
  (the refill), so this figure alone understates the work per job:
- `all_cpu_ms_per_job`: the CPU of the control and GPU worker processes together over the dispatch
  run, per job; baseline: the same over the raw run, per no-op task. No target: it says where the
  CPU goes (the builtin generator renders a small WAV or PNG for each job).
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime
from typing import Any

from animastor_tasks.dev.supervisor import wait_until
from bench.common import BenchResult, Context
from bench.farm import Farm, count_state, db_now, events

QUEUES = ("gpu.audio", "gpu.image")
LIMIT = 64
TARGET_RATIO = 0.8
TARGET_CPU_MS = 5.0


def _stages() -> dict[str, Any]:
    limits = {"lane_limit": LIMIT, "book_quota": LIMIT, "window": LIMIT, "params": {"steps": 1, "step_seconds": 0}}
    return {
        "audio": {"queue": "gpu.audio", "input": "text", "media_type": "audio/wav", **limits},
        "image": {"queue": "gpu.image", "input": "prompt", "media_type": "image/png", **limits},
    }


def raw_run(farm: Farm, jobs: int) -> dict[str, float]:
    """`jobs` no-op tasks over the two GPU queues; their rate and the control processes' CPU meanwhile."""
    app = farm.rt.ports.publisher.app
    ids = [uuid.uuid4().hex for _ in range(jobs)]
    cpu0, gpu0 = farm.control_cpu_seconds(), farm.gpu_cpu_seconds()
    sent = time.time()
    with app.producer_or_acquire() as producer:
        for n, task_id in enumerate(ids):
            app.send_task("celery.accumulate", args=(n,), queue=QUEUES[n % 2], task_id=task_id, producer=producer)
    client = app.backend.client
    keys = [app.backend.get_key_for_task(task_id) for task_id in ids]

    def done() -> bool:
        return sum(int(client.exists(*keys[i : i + 500])) for i in range(0, len(keys), 500)) >= jobs

    wait_until(done, 120, "raw tasks done", farm.sup.check, interval=0.02)
    cpu1, gpu1 = farm.control_cpu_seconds(), farm.gpu_cpu_seconds()
    metas = [json.loads(m) for i in range(0, len(keys), 500) for m in client.mget(keys[i : i + 500]) if m]
    last = max(datetime.fromisoformat(m["date_done"]).timestamp() for m in metas)
    return {
        "jobs_per_s": jobs / (last - sent),
        "seconds": last - sent,
        "control_cpu_s": cpu1 - cpu0,
        "all_cpu_s": cpu1 - cpu0 + gpu1 - gpu0,
    }


def dispatch_run(farm: Farm, books: list[str], jobs: int) -> dict[str, float]:
    cpu0, gpu0 = farm.control_cpu_seconds(), farm.gpu_cpu_seconds()
    sent = db_now()
    for book in books:
        farm.client.regenerate(book, list(farm.stages), wait=False)
    wait_until(lambda: count_state("ready") >= jobs, 600, f"{jobs} jobs ready", farm.sup.check, interval=0.05)
    cpu1, gpu1 = farm.control_cpu_seconds(), farm.gpu_cpu_seconds()
    last = max(at for *_, at in events(["job.ready"]))
    return {
        "jobs_per_s": jobs / (last - sent),
        "seconds": last - sent,
        "control_cpu_s": cpu1 - cpu0,
        "all_cpu_s": cpu1 - cpu0 + gpu1 - gpu0,
    }


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    n_books, scenes = (10, 25) if ctx.quick else (25, 40)
    jobs = n_books * scenes * 2
    books = [f"thru{i:02d}" for i in range(n_books)]
    raws: list[dict[str, float]] = []
    with Farm(_stages(), [(q, 2) for q in QUEUES]) as farm:
        farm.import_books(dict.fromkeys(books, scenes))
        farm.start()
        raw_run(farm, 40)  # warm: connections, pool processes
        ctx.log(f"throughput: {jobs} raw no-op tasks, then {jobs} jobs ({n_books} books x {scenes} x 2)")
        raws.append(raw_run(farm, jobs))
        dispatched = dispatch_run(farm, books, jobs)
        if not ctx.quick:
            raws.append(raw_run(farm, jobs))
    raw = sum(r["jobs_per_s"] for r in raws) / len(raws)
    ratio = dispatched["jobs_per_s"] / raw
    cpu_ms = dispatched["control_cpu_s"] * 1000 / jobs
    raw_cpu_ms = sum(r["control_cpu_s"] for r in raws) * 1000 / (jobs * len(raws))
    result.figure("raw_celery_jobs_per_s", raw, "jobs/s", baseline=" / ".join(f"{r['jobs_per_s']:.0f}" for r in raws))
    result.figure(
        "dispatch_jobs_per_s",
        dispatched["jobs_per_s"],
        "jobs/s",
        baseline=f"{ratio:.0%} of raw Celery {raw:.0f} jobs/s",
        target=f">= {TARGET_RATIO:.0%} of raw",
        ok=ratio >= TARGET_RATIO,
    )
    result.figure(
        "control_cpu_ms_per_job",
        cpu_ms,
        "ms CPU",
        baseline=f"control processes during raw run {raw_cpu_ms:.2f} ms/task",
        target=f"<= {TARGET_CPU_MS:g}",
        ok=cpu_ms <= TARGET_CPU_MS,
    )
    all_ms = dispatched["all_cpu_s"] * 1000 / jobs
    raw_all_ms = sum(r["all_cpu_s"] for r in raws) * 1000 / (jobs * len(raws))
    result.figure(
        "all_cpu_ms_per_job",
        all_ms,
        "ms CPU",
        baseline=f"control + GPU worker processes; a raw no-op task {raw_all_ms:.2f} ms",
    )
    result.notes["throughput"] = {
        "jobs": jobs,
        "raw_runs": raws,
        "dispatch": dispatched,
        "setup": " ".join(__doc__.split("\n\n")[1].split()),
    }
    return result
