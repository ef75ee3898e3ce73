"""A busy book beside readers' one-scene commands: the reads of its passes, refills and commits cost what its
pairs do, not its number of commands nor what the statistics last saw.

In process, on the bench stores: two books of N scenes (5,000; quick 2,000), audio only, every pair
`pending` under one whole-book command, as a book just regenerated stands. "Beside": the same, plus
20 one-scene commands whose pairs run (`generating`), as readers' scenes that jumped the queue do.
The statistics are taken while both books are idle (`dirty`), then the pairs go `pending`: too few
rows of a big table to set off autovacuum's analyze. Each figure is the median of 20 calls after 10
warm-up calls (psycopg prepares the statement; the server settles on a generic plan):

- `busy_commands_gate_rows_ms`: a pass's read of the book's in-flight pairs (`gate_rows_many`) on the
  book beside its commands, under the idle book's statistics; baseline: the same read after an ANALYZE.
  It took seconds once the generic plan read the commanded targets once per pair.
- `busy_commands_refill_read_ms`: a refill's candidate read (16 candidates), beside; baseline: alone.
  Each one-scene command walked the book's pending pairs looking for its running scene.
- `busy_commands_commit_settle_ms`: the settle of a job's commit (in a rolled-back transaction), beside;
  baseline: alone. It looked at every active command of the book, under the lane's lock.

Target for each: at most 2x its baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from animastor_tasks.adapters.postgres.settle import settle_commands
from bench.common import BenchResult, Context, analyze, make_runtime, median, pg_connect
from bench.seed import BookShape, add_command, load_books

ONE_SCENE_COMMANDS = 20
CANDIDATES = 16
CALLS = 20
WARM_UP = 10
TARGET_RATIO = 2.0


def _median_ms(call: Callable[[], object]) -> float:
    for _ in range(WARM_UP):
        call()
    times = []
    for _ in range(CALLS):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return median(times) * 1000


def _settle_ms(rt: Any, book: str, pair: tuple[str, str, str]) -> float:
    with rt.db.transaction() as conn:

        def settle() -> None:
            settle_commands(conn, book, pair)
            conn.rollback()

        return _median_ms(settle)


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    scenes = 2_000 if ctx.quick else 5_000
    alone, beside = BookShape("busy-alone", scenes, 1000), BookShape("busy-beside", scenes, 1000)
    load_books([alone, beside], lambda _book, _i, _stage: "dirty", ["audio"])
    analyze()  # the statistics see both books idle
    running = beside.keys()[-ONE_SCENE_COMMANDS:]
    with pg_connect() as conn:
        conn.execute(
            "UPDATE asset_states SET state = 'pending' WHERE book_id = ANY(%s)", ([alone.book_id, beside.book_id],)
        )
        conn.execute(
            "UPDATE asset_states SET state = 'generating', fencing_token = 1 WHERE book_id = %s"
            " AND (chapter_id, scene_id) IN (SELECT * FROM unnest(%s::text[], %s::text[]))",
            (beside.book_id, [c for c, _ in running], [s for _, s in running]),
        )
    for shape in (alone, beside):
        add_command(shape.book_id, "audio", shape.keys())
    for scene in running:
        add_command(beside.book_id, "audio", [scene])
    rt = make_runtime()
    try:
        reads = rt.ports.assets

        def gate_rows() -> Any:
            return reads.gate_rows_many([beside.book_id], limit=10_000)

        stale = _median_ms(gate_rows)
        analyze()
        fresh = _median_ms(gate_rows)
        refill = {
            shape.book_id: _median_ms(partial(reads.gate_candidates, shape.book_id, ["audio"], CANDIDATES))
            for shape in (alone, beside)
        }
        first = (*running[0], "audio")
        settle = {shape.book_id: _settle_ms(rt, shape.book_id, first) for shape in (alone, beside)}
    finally:
        rt.close()
    result.ms_within("busy_commands_gate_rows_ms", stale, fresh, "the same read after an ANALYZE", TARGET_RATIO)
    result.ms_within(
        "busy_commands_refill_read_ms", refill[beside.book_id], refill[alone.book_id], "alone", TARGET_RATIO
    )
    result.ms_within(
        "busy_commands_commit_settle_ms", settle[beside.book_id], settle[alone.book_id], "alone", TARGET_RATIO
    )
    result.notes["busy_commands"] = {
        "scenes": scenes,
        "one_scene_commands": ONE_SCENE_COMMANDS,
        "setup": " ".join(__doc__.split("\n\n")[1].split()),
    }
    return result
