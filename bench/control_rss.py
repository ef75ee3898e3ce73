"""Peak memory of a control process running one tick cycle over 100k and 1M active pairs.

The pairs are one book's (50,000 / 500,000 scenes x 2 stages, `pending` under active commands,
the Redis side of a regenerate written, the default stage limits, a consumer advertised): the
worst case for a pass that holds every pair of a book at once. A fresh control process
(`bench.control_loop`) runs one tick cycle — the tick and every control task it leads to — and
reports its own peak RSS (VmHWM). Baseline, same run: the same process over a one-scene book.

`control_rss_mb_100k`: at most 100 MB. `control_rss_mb_1m` (full mode only): bounded, i.e. at
most 1.5x the 100k figure — passes stream rows instead of holding every pair. The same for the beat's
reconcile task, run once in another fresh process (`reconcile_rss_mb_100k`, `reconcile_rss_mb_1m`): it held
the book's every in-flight pair to rebuild the active index (160 MB at 100k pairs, 1.1 GB at 1M).
"""

from __future__ import annotations

from typing import Any

from bench.common import BenchResult, Context, analyze, make_runtime, reset_stores, stage_table, timed
from bench.control_loop import run_control_process
from bench.seed import BookShape, add_commands_bulk, advertise_consumers, load_books, start_work

QUEUES = ["gpu.audio", "gpu.image"]
TARGET_MB = 100.0
BOUND_RATIO = 1.5


def cycle_rss(ctx: Context, scenes: int) -> dict[str, Any]:
    """Load one book of `scenes` x 2 pending pairs; one tick cycle in a fresh control process."""
    reset_stores()
    shape = BookShape("rss-book", scenes, 500)

    def load() -> None:
        load_books([shape], lambda _b, _i, _st: "pending")
        add_commands_bulk([shape])
        analyze()
        rt = make_runtime(stage_table(lease_ttl=3600))
        try:
            advertise_consumers(rt, QUEUES, ttl=3600)
            start_work(rt, [shape])
        finally:
            rt.close()

    load_s, _ = timed(load)
    out = run_control_process({"queues": QUEUES, "cycles": 1}, stage_table(lease_ttl=3600))
    repair = run_control_process({"queues": QUEUES, "cycles": 0, "reconcile": True}, stage_table(lease_ttl=3600))
    cycle = out["cycles"][0]
    ctx.log(
        f"control_rss: {scenes * 2:,} pairs: peak {out['rss_peak_mb']:.1f} MB (start {out['rss_start_mb']:.1f});"
        f" cycle {cycle['ms']:.0f} ms; reconcile peak {repair['rss_peak_mb']:.1f} MB, {repair['reconcile_ms']:.0f} ms;"
        f" loaded in {load_s:.1f}s"
    )
    return {
        "reconcile_rss_peak_mb": repair["rss_peak_mb"],
        "reconcile_ms": round(repair["reconcile_ms"], 1),
        "pairs": scenes * 2,
        "load_s": round(load_s, 1),
        "rss_peak_mb": out["rss_peak_mb"],
        "rss_start_mb": round(out["rss_start_mb"], 1),
        "cycle_ms": round(cycle["ms"], 1),
        "control_tasks": cycle["control_tasks"],
        "jobs_queued": cycle["queued_jobs"],
        "errors": out["errors"],
    }


def _figures(
    result: BenchResult,
    name: str,
    key: str,
    big: dict[str, Any],
    huge: dict[str, Any] | None,
    base: str,
    huge_base: str,
) -> None:
    """`name`_100k, at most TARGET_MB, and (full mode) `name`_1m, bounded: at most BOUND_RATIO x the 100k figure."""
    mb = big[key]
    result.figure(f"{name}_100k", mb, "MB", baseline=base, target=f"<= {TARGET_MB:g}", ok=mb <= TARGET_MB)
    if huge is not None:
        result.figure(
            f"{name}_1m",
            huge[key],
            "MB",
            baseline=f"{huge_base}; 100k {mb:.1f} MB",
            target=f"<= {BOUND_RATIO}x 100k (bounded)",
            ok=huge[key] <= BOUND_RATIO * mb,
        )


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    try:
        tiny = cycle_rss(ctx, 1)
        big = cycle_rss(ctx, 50_000)
        huge = None if ctx.quick else cycle_rss(ctx, 500_000)
    finally:
        reset_stores()
    base = f"1-scene cycle {tiny['rss_peak_mb']:.1f} MB"
    _figures(result, "control_rss_mb", "rss_peak_mb", big, huge, base, base)
    took = f"{big['reconcile_ms'] / 1000:.1f} s"
    base = f"{took}; 1-scene {tiny['reconcile_rss_peak_mb']:.1f} MB"
    huge_took = None if huge is None else f"{huge['reconcile_ms'] / 1000:.1f} s"
    _figures(result, "reconcile_rss_mb", "reconcile_rss_peak_mb", big, huge, base, huge_took or "")
    result.notes["control_rss"] = {
        "1": tiny,
        "100k": big,
        "1m": huge if huge is not None else "quick mode: not measured (full mode loads 1M pairs)",
        "setup": " ".join(__doc__.split("\n\n")[1].split()),
    }
    return result
