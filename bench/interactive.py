"""A reader's scene ahead of a bulk backlog: how many jobs start before an `interactive` one does.

Real processes (`bench.farm`): control worker, beat, two single-process GPU workers on
`gpu.audio` (`lane_limit` 2, default quota and window), builtin jobs of 0.3 s. Bulk books are
regenerated with `priority="bulk"` and keep both slots busy with a long backlog; then, one at
a time, a single-scene regenerate of a reader's book is sent with `priority="interactive"`,
and the journal says how many jobs started between sending it (database clock) and its own
start. Running jobs are not preempted, so the best possible is at most one per slot.

`interactive_jobs_before_worst`: the most over all samples; at most the lane's slot count.
Baseline, same run: the bulk backlog still waiting when the samples ended (it must not be 0).
"""

from __future__ import annotations

import random
import time
from functools import partial

from animastor_tasks.dev.supervisor import wait_until
from bench.common import BenchResult, Context, median
from bench.farm import Farm, audio_stage, count_state, db_now, events

SLOTS = 2
STEP_SECONDS = 0.15
READER = "reader"


def _stages() -> dict[str, object]:
    return {"audio": audio_stage(SLOTS, STEP_SECONDS)}


def _started_at(scene: str) -> float | None:
    rows = [at for _, _, s, _, at in events(["job.started"], [READER]) if s == scene]
    return rows[0] if rows else None


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    bulk_books, bulk_scenes, samples = (6, 15, 6) if ctx.quick else (8, 30, 15)
    bulk = [f"bulk{i:02d}" for i in range(bulk_books)]
    before: list[int] = []
    waits: list[float] = []
    with Farm(_stages(), [("gpu.audio", 1)] * SLOTS, tick_seconds=1) as farm:
        farm.import_books({**dict.fromkeys(bulk, bulk_scenes), READER: samples})
        farm.start()
        for book in bulk:
            farm.client.regenerate(book, ["audio"], priority="bulk", wait=False)
        wait_until(lambda: len(events(["job.started"])) >= SLOTS, 60, "bulk jobs running", farm.sup.check)
        ctx.log(f"interactive: {bulk_books} bulk books x {bulk_scenes} on {SLOTS} slots; {samples} samples")
        for i in range(samples):
            scene = f"s{i:04d}"
            time.sleep(random.uniform(0.05, 2 * STEP_SECONDS))  # land anywhere within a running job
            sent = db_now()
            farm.client.regenerate(READER, ["audio"], [("ch1", scene)], priority="interactive", wait=False)
            started = float(wait_until(partial(_started_at, scene), 60, f"{scene} started", farm.sup.check))
            others = [at for kind, b, _, _, at in events(["job.started"]) if b != READER and sent < at < started]
            before.append(len(others))
            waits.append(started - sent)
        backlog = count_state("pending", bulk)
    worst = max(before)
    result.figure(
        "interactive_jobs_before_worst",
        worst,
        "jobs",
        baseline=f"{SLOTS} slots; bulk still pending at the end {backlog}; per sample {before}",
        target=f"<= {SLOTS}",
        ok=worst <= SLOTS and backlog > 0,
    )
    result.figure("interactive_wait_median_s", median(waits), "s", baseline=f"worst {max(waits):.2f}s")
    result.notes["interactive"] = {
        "jobs_before": before,
        "waits_s": [round(w, 3) for w in waits],
        "bulk_pending_at_end": backlog,
        "setup": " ".join(__doc__.split("\n\n")[1].split()),
    }
    return result
