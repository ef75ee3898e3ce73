"""A reader's one scene in a big book: the regenerate costs what the scene does, not what the book holds.

In process, on the bench stores, with a fake live consumer: a book of N scenes (50,000; quick 10,000),
audio only, under a whole-book bulk command, as the tick leaves it with its lane full: every pair but
the running ones `pending`, each deferred for capacity (Redis), the scenes in the active index. Beside it
a book of 20 scenes, idle. Each figure is the median of 10 `regenerate` calls (the flow itself, as the
control worker runs it) of one scene never asked for before, `interactive`, after 2 warm-up calls:

- `big_book_regenerate_ms`: in the big book; baseline: the same in the small book. Target: at most 2x.
  Each one passed over every pair of the book in flight and read its sets from Redis: 498 ms at 50,000.
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import BenchResult, Context, analyze, make_runtime, median
from bench.seed import BookShape, activate, add_command, add_deferrals, advertise_consumers, load_books

CALLS = 10
WARM_UP = 2
TARGET_RATIO = 2.0


def _regenerate_ms(rt: Any, shape: BookShape) -> float:
    from animastor_tasks.flow.regenerate import regenerate

    keys = shape.keys()
    times = []
    for n in range(WARM_UP + CALLS):
        chapter, scene = keys[-1 - n]
        started = time.perf_counter()
        regenerate(rt.ports, shape.book_id, ["audio"], [[chapter, scene]], priority="interactive")
        times.append(time.perf_counter() - started)
    return median(times[WARM_UP:]) * 1000


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    scenes = 10_000 if ctx.quick else 50_000
    big, small = BookShape("regen-big", scenes, 500), BookShape("regen-small", 20, 500)
    rt = make_runtime()
    try:
        running = rt.ports.settings.registry.get("audio").lane_limit
        load_books(
            [big, small],
            lambda book, i, _stage: ("generating" if i < running else "pending") if book == big.book_id else "dirty",
            ["audio"],
        )
        add_command(big.book_id, "audio", big.keys())
        analyze()  # as autovacuum leaves it after the command's insert
        activate(rt, big.book_id, big.keys())
        add_deferrals(rt, big.book_id, [(c, s, "audio") for c, s in big.keys()[running:]], "capacity", 600)
        advertise_consumers(rt, rt.ports.settings.registry.queues())
        ctx.log(f"big_book_regenerate: one interactive scene, {scenes:,} pending pairs vs 20 idle scenes")
        alone = _regenerate_ms(rt, small)
        beside = _regenerate_ms(rt, big)
    finally:
        rt.close()
    pending = f"; {scenes:,} pairs pending"
    result.ms_within("big_book_regenerate_ms", beside, alone, "a book of 20 scenes", TARGET_RATIO, pending)
    result.notes["big_book_regenerate"] = {"scenes": scenes, "setup": " ".join(__doc__.split("\n\n")[1].split())}
    return result
