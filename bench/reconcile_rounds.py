"""What one reconcile costs as the farm grows: a pass takes the next books up to a budget of pairs in flight.

Setup per farm (BOOKS x 500 scenes x 2 stages, every pair `pending` under one active command per book and
stage, the Redis side of a regenerate written, ANALYZE), then in this process on the bench stores:

- `reconcile_whole_ms_<N>`: one pass over every book with work (`animastor-tasks reconcile`, and what
  every beat pass did before the turns): the cost follows the farm.
- `reconcile_pass_ms_<N>`: the beat's passes, one whole round of them with the default budget
  (`ANIMASTOR_RECONCILE_PAIRS`, 100,000 pairs): the median pass of the round. Target: at most 1.5x the
  100k farm's pass measured in the same run (the mean of its whole pass and its beat pass, the same
  work): a pass costs what the budget holds, not the farm. What still reads the whole farm is small:
  the books with work and their pair counts, the layers of each book, the running jobs.
- `reconcile_pass_ms_<N>_slowest`: the slowest pass of the round; target: under 0.8x the reconcile
  period (the beat's singleton lock), so two passes never overlap.
- `reconcile_round_passes_<N>`: the passes a round took (each book repaired once per round).

Full mode: 100 books (100k pairs, the baseline) and 1,000 books (1M pairs). Quick: 100 and 300 books.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.common import BenchResult, Context, analyze, make_runtime, reset_stores, stage_table, timed
from bench.seed import BookShape, add_commands_bulk, load_books, start_work

SCENES = 500  # per book: 1,000 pairs with both stages
TARGET_RATIO = 1.5


def _farm(books: int) -> Any:
    """Load the farm; a runtime on it (long leases: nothing expires while passes run)."""
    reset_stores()
    shapes = [BookShape(f"rr{n:05d}", SCENES, 500) for n in range(books)]
    load_books(shapes, lambda _b, _i, _st: "pending")
    add_commands_bulk(shapes)
    analyze()
    rt = make_runtime(stage_table(lease_ttl=3600))
    start_work(rt, shapes)
    return rt


def measure(ctx: Context, books: int) -> dict[str, Any]:
    from animastor_tasks.flow import reconcile as reconcile_flow

    load_s, rt = timed(lambda: _farm(books))
    try:
        reconcile_flow.reconcile(rt.ports, force=True, whole=True)  # warm: plans, pool, the bookmark set
        whole_s, whole = timed(lambda: reconcile_flow.reconcile(rt.ports, force=True, whole=True))
        passes: list[float] = []
        visited = 0
        for _ in range(books + 1):
            seconds, report = timed(lambda: reconcile_flow.reconcile(rt.ports, force=True))
            passes.append(seconds * 1000)
            visited += report["passed_books"]
            if report["round_done"]:
                break
    finally:
        rt.close()
    pairs = books * SCENES * 2
    ctx.log(
        f"reconcile_rounds: {pairs:,} pairs in {books} books (loaded in {load_s:.0f}s): whole {whole_s * 1000:.0f} ms;"
        f" {len(passes)} passes, slowest {max(passes):.0f} ms"
    )
    if whole["passed_books"] != books or visited != books:
        raise RuntimeError(f"a round did not visit each of {books} books once: whole {whole}, round {visited}")
    return {"whole_ms": whole_s * 1000, "pass_ms": max(passes), "passes": passes, "pairs": pairs, "books": books}


def run(ctx: Context) -> BenchResult:
    from animastor_tasks.config import Settings
    from animastor_tasks.domain.liveness import PERIODIC_LOCK_SHARE

    result = BenchResult()
    settings = Settings()
    budget = settings.reconcile_pairs
    limit = settings.reconcile_seconds * PERIODIC_LOCK_SHARE * 1000  # the beat's singleton lock
    base = measure(ctx, 100)
    big = measure(ctx, 300 if ctx.quick else 1000)
    # The 100k farm fits the budget: its beat pass and its whole pass do the same work; their mean is the baseline.
    base_ms = (base["whole_ms"] + base["pass_ms"]) / 2
    result.figure("reconcile_whole_ms_100k", base["whole_ms"], "ms", baseline=f"beat pass {base['pass_ms']:.0f} ms")
    result.figure(
        "reconcile_whole_ms_1m",
        big["whole_ms"],
        "ms",
        baseline=f"every book, {big['books']} x 1,000 pairs ({big['whole_ms'] / base_ms:.1f}x the 100k pass)",
    )
    typical = statistics.median(big["passes"])
    result.figure(
        "reconcile_pass_ms_1m",
        typical,
        "ms",
        baseline=f"round median; {typical / base_ms:.2f}x the 100k pass ({base_ms:.0f} ms); budget {budget:,} pairs",
        target=f"<= {TARGET_RATIO:g}x the 100k pass",
        ok=typical <= TARGET_RATIO * base_ms,
    )
    result.figure(
        "reconcile_pass_ms_1m_slowest",
        big["pass_ms"],
        "ms",
        baseline=f"{big['pass_ms'] / base_ms:.2f}x the 100k pass; the whole pass {big['whole_ms']:.0f} ms",
        target=f"< {limit:.0f} ms (the beat's lock)",
        ok=big["pass_ms"] < limit,
    )
    result.figure("reconcile_round_passes_1m", len(big["passes"]), "passes", baseline="one round, every book once")
    result.notes["reconcile_rounds"] = {
        "budget_pairs": budget,
        "farms": [
            {k: (round(v, 1) if isinstance(v, float) else v) for k, v in m.items() if k != "passes"}
            | {"passes_ms": [round(p, 1) for p in m["passes"]]}
            for m in (base, big)
        ],
        "quick": "the big farm is 300 books (300k pairs) under the 1m names" if ctx.quick else None,
    }
    return result
