"""A reader asks again for a scene whose job is running: how long until its fresh run starts.

Real processes (`bench.farm`): control worker, beat (the tick every 5 s, as deployed), one
single-process GPU worker on `gpu.audio` (`lane_limit` 1, lease TTL 120 s, the default), builtin
jobs of 20 s. Each sample: a scene is regenerated and its job started; moments later (0.5-1.5 s)
the same scene is regenerated with `force` (the default); the journal says when the fresh run
started (database clock). The book is then stopped (Stop All) and the lane left empty before
the next sample.

`forced_rerun_start_s`: the median, from the forced regenerate's sending to the fresh run's
start; `forced_rerun_start_s_worst`: the most. The fenced-off job must stop and the pair be handed
back before the fresh run can start: the lane has one slot.
"""

from __future__ import annotations

import random
import time

from animastor_tasks.dev.supervisor import wait_until
from bench.common import BenchResult, Context, median
from bench.farm import Farm, count_state, db_now, events

BOOK = "rerun"
JOB_SECONDS = 20.0


def _stages() -> dict[str, object]:
    return {
        "audio": {
            "queue": "gpu.audio",
            "input": "text",
            "media_type": "audio/wav",
            "lane_limit": 1,
            "params": {"steps": 200, "step_seconds": JOB_SECONDS / 200},
        }
    }


def _starts(scene: str) -> list[float]:
    return [at for _, _, s, _, at in events(["job.started"], [BOOK]) if s == scene]


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    samples = 3 if ctx.quick else 6
    delays: list[float] = []
    with Farm(_stages(), [("gpu.audio", 1)]) as farm:
        farm.import_books({BOOK: samples})
        farm.start()
        ctx.log(f"forced_rerun: {samples} samples, jobs of {JOB_SECONDS:g} s on one slot")
        for i in range(samples):
            scene = f"s{i:04d}"
            farm.client.regenerate(BOOK, ["audio"], [("ch1", scene)])
            wait_until(lambda s=scene: len(_starts(s)) >= 1, 60, f"{scene} started", farm.sup.check)
            time.sleep(random.uniform(0.5, 1.5))  # well inside its run
            sent = db_now()
            farm.client.regenerate(BOOK, ["audio"], [("ch1", scene)], force=True)
            starts = wait_until(lambda s=scene: _starts(s)[1:] or None, 60, f"{scene} run again", farm.sup.check)
            delays.append(float(starts[0]) - sent)
            farm.client.cancel(BOOK)
            wait_until(lambda: count_state("generating", [BOOK]) == 0, 60, "the lane empty", farm.sup.check)
    result.figure(
        "forced_rerun_start_s",
        median(delays),
        "s",
        baseline=f"{len(delays)} samples; jobs of {JOB_SECONDS:g} s, lease TTL 120 s, tick 5 s",
    )
    result.figure("forced_rerun_start_s_worst", max(delays), "s", baseline="the longest of the samples")
    result.notes["forced_rerun"] = {"delays_s": [round(d, 3) for d in delays], "setup": " ".join(__doc__.split())}
    return result
