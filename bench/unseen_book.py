"""A big book the planner's statistics have not seen: its operator's commands cost what its pairs do.

In process, on the bench stores. The farm: five books of three scenes, each regenerated (audio), then an
ANALYZE, so the statistics know every book there is, as a small farm's do. Then a book of N scenes (2,000;
quick 1,000) is imported and worked as an operator would, each step timed once:

- `unseen_book_status_ms`: `status` of the book (every pair `dirty`);
- `unseen_book_regenerate_ms`: `regenerate` of `all` its stages: a consumer is advertised for audio only, so
  the audio pairs go `pending` and the first pass dispatches the lane's slots, and the image stage is BLOCKED
  (its pairs released);
- `unseen_book_gate_pass_ms`: the next gate pass of the book (its pending pairs and their targets read);
- `unseen_book_cancel_ms`: Stop All (`cancel`) of the book, every pending pair released.

The image stage's lack of a worker is on record before each step (a double count noted it, as on a farm whose
image workers went a while ago): a regenerate that finds it first counts it again a heartbeat later
(`lanes.gone_for_good`, 2.5 s asleep), which is no cost of the plans measured here.

Baseline: the same steps on a twin book with an ANALYZE before each, so its plans are made on statistics that
know it. No autovacuum comes between: a new book under a tenth of a big table never sets it off. Each of the
four was a nested loop that read the book's pairs once per pair (2,000 scenes: 0.7 s, 1.1 s, 9 s and 1 s).
Target for each: at most 2x its baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from animastor_tasks.domain.book import Book
from animastor_tasks.domain.book_json import parse_book_json
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow import status as status_flow
from bench.common import BenchResult, Context, analyze, make_runtime
from bench.farm import book_json
from bench.seed import advertise_consumers

SMALL_BOOKS = 5
TARGET_RATIO = 2.0
STEPS = ("status", "regenerate", "gate_pass", "cancel")


def book(book_id: str, scenes: int) -> Book:
    return parse_book_json(book_json(book_id, scenes))


def _steps(rt: Any, book_id: str, before: Callable[[], None]) -> dict[str, float]:
    """Each step's milliseconds on `book_id`, `before` run ahead of each (an ANALYZE for the baseline)."""
    calls: dict[str, Callable[[], object]] = {
        "status": lambda: status_flow.status(rt.ports, book_id),
        "regenerate": lambda: regenerate_flow.regenerate(rt.ports, book_id, ["all"]),
        "gate_pass": lambda: gate.gate_pass(rt.ports, book_id),
        "cancel": lambda: cancel_flow.cancel(rt.ports, book_id, "bench"),
    }
    spent = {}
    for step in STEPS:
        before()
        started = time.perf_counter()
        calls[step]()
        spent[step] = (time.perf_counter() - started) * 1000
    return spent


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    scenes = 1_000 if ctx.quick else 2_000
    rt = make_runtime()
    try:
        advertise_consumers(rt, ["gpu.audio"])  # none for images: that stage is BLOCKED
        for i in range(SMALL_BOOKS):
            rt.catalog.import_book(book(f"small-{i}", 3))
            regenerate_flow.regenerate(rt.ports, f"small-{i}", ["audio"])
        analyze()
        rt.catalog.import_book(book("unseen", scenes))
        unseen = _steps(rt, "unseen", lambda: rt.presence.note_unconsumed(["gpu.image"]))
        rt.catalog.import_book(book("known", scenes))
        known = _steps(rt, "known", lambda: (rt.presence.note_unconsumed(["gpu.image"]), analyze()))
    finally:
        rt.close()
    for step in STEPS:
        result.ms_within(
            f"unseen_book_{step}_ms", unseen[step], known[step], "the same on a book the statistics know", TARGET_RATIO
        )
    result.notes["unseen_book"] = {"scenes": scenes, "setup": " ".join(__doc__.split("\n\n")[1].split())}
    ctx.log(f"unseen_book: {scenes} scenes; unseen {unseen}; known {known}")
    return result
