"""A book alone on a lane uses every slot: `book_quota` and `window` are fair shares, not caps.

Real processes (`bench.farm`): control worker, beat, one GPU worker of 8 processes on
`gpu.audio`, whose stage has `lane_limit` 8 and the default `book_quota` and `window` (4 and 4).
One book of many scenes is regenerated alone; builtin jobs of 0.3 s (2 steps x 0.15 s).

`lone_book_busy_fraction`: busy slot-seconds (job.started -> job.ready, journal) over the 8
slots' seconds from the first dispatch until the backlog is empty (the last job started); at
least 0.95. Beside it, same run: the fraction from the first start to the last end
(`lone_book_busy_fraction_to_last_end`, the window of earlier runs), the fraction a hard cap
at the default quota would allow (4 of 8 = 0.5), and the ceiling of bare Celery
(`lone_book_busy_fraction_raw_celery`, `bench.rawchain`: the same 8 processes and jobs, each job
sending the next at its end, no orchestration).
"""

from __future__ import annotations

from bench import rawchain
from bench.common import BenchResult, Context
from bench.farm import Farm, audio_stage, busy_fraction, events, wait_ready

SLOTS = 8
STEP_SECONDS = 0.15
TARGET = 0.95
BOOK = "lone-book"


def _stages() -> dict[str, object]:
    return {"audio": audio_stage(SLOTS, STEP_SECONDS)}


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    scenes = 48 if ctx.quick else 160
    with Farm(_stages(), [("gpu.audio", SLOTS)], tick_seconds=1) as farm:
        farm.import_books({BOOK: scenes})
        farm.start()
        ctx.log(f"lone_book: {scenes} scenes alone on {SLOTS} slots, jobs {2 * STEP_SECONDS:.1f}s")
        farm.client.regenerate(BOOK, ["audio"], wait=False)
        wait_ready(farm, [BOOK], scenes, scenes * 2 * STEP_SECONDS + 120)
        rows = events(["dispatch", "job.started", "job.ready"], [BOOK])
    raw = rawchain.measure([SLOTS], scenes, 2 * STEP_SECONDS)
    result.figure(
        "lone_book_busy_fraction_raw_celery",
        raw.fraction,
        baseline=f"bare Celery on {SLOTS} processes, the same jobs and window; each job sends the next at its end",
    )
    busy = busy_fraction(rows, SLOTS)
    note = f"; a hard cap at book_quota 4 gives 0.5; bare Celery {raw.fraction:.3f}"
    busy.add_figures(result, "lone_book_busy_fraction", SLOTS, TARGET, note)
    result.notes["lone_book"] = {"scenes": scenes, "span_s": round(busy.span, 2), "setup": " ".join(__doc__.split())}
    return result
