"""A tick over 100,000 active pairs: 50 books x 1,000 scenes x 2 stages, almost all deferred.

A tick enqueues one gate task per active book; the control worker then runs one gate
pass per book. This measures the whole of that work in one process: the tick itself plus
the 50 gate passes it asks for (run here in-process, as the control worker would), with a
live consumer advertised on both queues. Every pair is pending under an active command;
all but the first 10 scenes of each book are deferred (capacity bucket), so the passes
decide 100k pairs and dispatch only what the lane allows. Round trips per pass are
counted for one pass (the gate benchmark shows they do not grow with the pair count). The
quick run uses 10 books.
"""

from __future__ import annotations

from typing import Any

from bench.common import BenchResult, Context, analyze, make_runtime, reset_stores, stage_table, timed
from bench.round_trips import count_round_trips
from bench.seed import BookShape, activate, add_command, add_deferrals, advertise_consumers, load_books, schedule

SCENES = 1_000
TARGET_MS = 2_000.0


def setup(rt: Any, books: int) -> list[str]:
    reset_stores()
    shapes = [BookShape(f"active-{n:03d}", SCENES, 250) for n in range(books)]
    load_books(shapes, lambda _b, _i, _st: "pending")
    for shape in shapes:
        keys = shape.keys()
        for stage in ("audio", "image"):
            add_command(shape.book_id, stage, keys)
        deferred = [(c, s, st) for c, s in keys[10:] for st in ("audio", "image")]
        add_deferrals(rt, shape.book_id, deferred, "capacity", 3600)
        activate(rt, shape.book_id, keys)
        schedule(rt, shape.book_id)  # due for a pass, as a regenerate leaves it (a due-time index, if any)
    analyze()
    advertise_consumers(rt, ["gpu.audio", "gpu.image"])
    return [s.book_id for s in shapes]


def one_tick(rt: Any) -> tuple[int, dict[str, int]]:
    """The tick and every gate pass it enqueues; (books passed, dispatch outcomes)."""
    from collections import Counter

    from animastor_tasks.flow import gate

    rt.redis.client.delete(rt.redis.keys.lock("tick"))
    books = gate.tick(rt.ports)
    outcomes: Counter[str] = Counter()
    for book in books:
        outcomes.update(gate.gate_pass(rt.ports, book).outcomes)
    return len(books), dict(outcomes)


def round_trips_per_pass(rt: Any, book: str) -> int:
    from animastor_tasks.flow import gate

    with count_round_trips(rt) as trips:
        gate.gate_pass(rt.ports, book)
    return trips.total


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    books = 10 if ctx.quick else 50
    rt = make_runtime(stage_table(lane_limit=8, book_quota=4, window=4))
    try:
        names = setup(rt, books)
        ctx.log(f"tick_active: {books} books x {SCENES} scenes x 2 stages loaded")
        first_ms, (passed, first_outcomes) = timed(lambda: one_tick(rt))
        seconds, (passed, outcomes) = timed(lambda: one_tick(rt))
        trips = round_trips_per_pass(rt, names[0])
    finally:
        rt.close()
        reset_stores()
    pairs = books * SCENES * 2
    label = "100k" if books == 50 else f"{pairs // 1000}k"
    result.figure(
        f"tick_ms_active_{label}",
        seconds * 1000,
        "ms",
        baseline=f"first tick (dispatching) {first_ms * 1000:.0f} ms; {passed} gate passes",
        target=f"<= {TARGET_MS:.0f} ms" if books == 50 else "",
        ok=(seconds * 1000 <= TARGET_MS) if books == 50 else None,
    )
    result.figure(f"tick_us_per_active_pair_{label}", seconds * 1e6 / pairs, "us")
    result.figure(
        "tick_gate_roundtrips_per_pass",
        trips,
        "",
        baseline="per book of 2,000 pairs (constant: see gate_roundtrips_1k/10k)",
    )
    result.notes["tick_active"] = {"outcomes_first": first_outcomes, "outcomes_second": outcomes, "books": books}
    return result
