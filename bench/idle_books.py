"""One working book's throughput alone, and beside 1,000 active books that have nothing to do.

Real processes (`bench.farm`): control worker, beat (tick every 5 s, the default), one GPU
worker of 4 processes on `gpu.audio` (`lane_limit` 4, default quota and window, builtin jobs of
0.2 s). The 1,000 idle books each have one scene `pending` on the image stage under an active
command (COPY, and the Redis side of a regenerate), but the image lane is full: 8 other books hold
its 8 slots (one gate pass each, leases of an hour; a consumer is advertised on `gpu.image` and
nothing consumes). So they are active, and there is nothing to do for them.

Same run, same workers: a working book of 100 audio scenes regenerated alone, then, once the
idle books are active and a tick has passed, a second one beside them. Jobs per second = 100 /
(last job.ready - send time, database clock); first dispatch = its first `dispatch` event - send.

`busy_book_jobs_per_s_with_1000_idle_books`: at least 90% of `busy_book_jobs_per_s_alone`, and
its first dispatch under 1 s (`busy_book_first_dispatch_s_with_1000_idle_books`).
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import BenchResult, Context, purge_queues
from bench.farm import Farm, audio_stage, db_now, events, wait_ready
from bench.seed import BookShape, add_commands_bulk, load_books, start_work

SLOTS = 4
JOBS = 100
IDLE = 1000
STEP_SECONDS = 0.1
TARGET_RATIO = 0.9
TARGET_FIRST_S = 1.0


def _stages() -> dict[str, Any]:
    return {
        "audio": audio_stage(SLOTS, STEP_SECONDS),
        "image": {"queue": "gpu.image", "input": "prompt", "media_type": "image/png", "lease_ttl": 3600},
    }


def _work(farm: Farm, book: str) -> dict[str, float]:
    sent = db_now()
    farm.client.regenerate(book, ["audio"], wait=False)
    wait_ready(farm, [book], JOBS, 300)
    rows = events(["dispatch", "job.ready"], [book])
    first = min(at for kind, *_, at in rows if kind == "dispatch")
    last = max(at for kind, *_, at in rows if kind == "job.ready")
    return {"jobs_per_s": JOBS / (last - sent), "first_dispatch_s": first - sent, "seconds": last - sent}


def _idle_books(farm: Farm) -> int:
    """Fill the image lane with 8 runner books' jobs, then make the 1,000 idle books active."""
    from animastor_tasks.flow.gate import gate_pass

    runners = [BookShape(f"aa-runner-{n}", 1, 250) for n in range(8)]
    idle = [BookShape(f"idle-{n:04d}", 1, 250) for n in range(IDLE)]
    load_books([*runners, *idle], lambda _b, _i, _st: "pending", stages=("image",))
    add_commands_bulk([*runners, *idle], stages=("image",))
    start_work(farm.rt, runners, stages=("image",))
    held = sum(len(gate_pass(farm.rt.ports, r.book_id).dispatched) for r in runners)
    purge_queues(["gpu.image"])
    start_work(farm.rt, idle, stages=("image",))
    return held


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    with Farm(_stages(), [("gpu.audio", SLOTS)]) as farm:
        farm.import_books({"busy-alone": JOBS, "busy-crowd": JOBS})
        farm.rt.presence.heartbeat("bench-image@host", ["gpu.image"], 3600)
        farm.start()
        ctx.log(f"idle_books: {JOBS} jobs alone on {SLOTS} slots")
        alone = _work(farm, "busy-alone")
        held = _idle_books(farm)
        time.sleep(farm.rt.settings.tick_seconds + 1)  # the idle books are in play: a tick has seen them
        ctx.log(f"idle_books: image lane held by {held} jobs, {IDLE} idle books active; {JOBS} jobs beside them")
        crowd = _work(farm, "busy-crowd")
    ratio = crowd["jobs_per_s"] / alone["jobs_per_s"]
    result.figure("busy_book_jobs_per_s_alone", alone["jobs_per_s"], "jobs/s", baseline=f"{SLOTS} slots, 0.2 s jobs")
    result.figure(
        "busy_book_jobs_per_s_with_1000_idle_books",
        crowd["jobs_per_s"],
        "jobs/s",
        baseline=f"{ratio:.0%} of alone ({alone['jobs_per_s']:.1f})",
        target=f">= {TARGET_RATIO:.0%} of alone",
        ok=ratio >= TARGET_RATIO,
    )
    result.figure(
        "busy_book_first_dispatch_s_with_1000_idle_books",
        crowd["first_dispatch_s"],
        "s",
        baseline=f"alone {alone['first_dispatch_s']:.2f} s",
        target=f"< {TARGET_FIRST_S:g} s",
        ok=crowd["first_dispatch_s"] < TARGET_FIRST_S,
    )
    result.notes["idle_books"] = {
        "alone": alone,
        "with_idle_books": crowd,
        "image_slots_held": held,
        "setup": " ".join(__doc__.split("\n\n")[1].split()),
    }
    return result
