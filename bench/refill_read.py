"""A refill's candidate read at a small and a big book: its cost follows the slots, not the book.

In process, on the bench stores: two books under one active command each, the first half of their
scenes done (`ready`) and the rest `pending`, as a book part-way through its regeneration stands:
1,000 and 50,000 pending pairs. `refill_read_ms_{1k,50k}_pending` is the median of 50 calls of the
refill's read (`AssetStore.gate_candidates`, 16 candidates, the limit of a lane of 8 slots) after
10 warm-up calls (psycopg prepares the statement and the server settles on its plan); the big
book's time over the small one's is `refill_read_ratio_50k_vs_1k`, about 1 when the read stops at
its limit (before migration 0006 it read every pending pair: 5.3 ms at 1,000, 222 ms at 50,000).
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import BenchResult, Context, make_runtime, median
from bench.seed import BookShape, add_command, load_books

CANDIDATES = 16
CALLS = 50
WARM_UP = 10
TARGET_RATIO = 2.0


def _time_read(rt: Any, book: str) -> float:
    assets = rt.ports.assets
    for _ in range(WARM_UP):
        assets.gate_candidates(book, ["audio"], CANDIDATES)
    times = []
    for _ in range(CALLS):
        started = time.perf_counter()
        rows = assets.gate_candidates(book, ["audio"], CANDIDATES)
        times.append(time.perf_counter() - started)
        assert rows is not None and len(rows.in_flight) == CANDIDATES
    return median(times) * 1000


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    pending = {"1k": 1_000, "50k": 50_000 if not ctx.quick else 10_000}
    shapes = {size: BookShape(f"refill-read-{size}", 2 * n, 1000) for size, n in pending.items()}
    done = {shapes[size].book_id: n for size, n in pending.items()}  # the first half of each book
    load_books(list(shapes.values()), lambda book, i, _st: "ready" if i < done[book] else "pending", ["audio"])
    for shape in shapes.values():
        add_command(shape.book_id, "audio", shape.keys())
    rt = make_runtime()
    ms = {size: _time_read(rt, shapes[size].book_id) for size in pending}
    ratio = ms["50k"] / ms["1k"]
    for size, n in pending.items():
        result.figure(f"refill_read_ms_{size}_pending", ms[size], "ms", baseline=f"{n:,} pending pairs, {n:,} done")
    result.figure(
        "refill_read_ratio_50k_vs_1k",
        ratio,
        "x",
        baseline=f"{ms['50k']:.2f} ms / {ms['1k']:.2f} ms",
        target=f"<= {TARGET_RATIO:g}",
        ok=ratio <= TARGET_RATIO,
    )
    result.notes["refill_read"] = {"pending": pending, "setup": " ".join(__doc__.split("\n\n")[1].split())}
    return result
