"""How busy the GPU slots stay while many books wait: work conservation and fair share, measured.

Workers (subprocesses, on the bench stores): one control worker, beat, and as many single-process
GPU workers as the lane has slots. Many small books are regenerated together on one lane with
`book_quota` 1, so every book but the first few must be handed a slot another book's job freed.
"Together": the regenerates are sent without waiting for each other's results. Their commands are
written over about 0.4 s, longer than a job: a book whose command comes while another book's job runs
waits ahead of that book's next job (round robin, `domain.deferral.served_since`).

- `lane_busy_fraction`: busy slot-seconds (job.started -> job.ready, from the journal) over the
  slot-seconds available from the first dispatch until the backlog is empty (the last job started).
  1.0 is every slot busy throughout. `lane_busy_fraction_to_last_end`: the same from the first start
  to the last end (the window of earlier runs; it also counts the tail, when no work waits).
  `lane_busy_fraction_raw_celery`: the ceiling of bare Celery (`bench.rawchain`) on as many
  single-process workers, the same number of jobs of the same length, each job sending the next at
  its end, in the same window.
- `first_start_index_worst`: the index (in start order) of the job at which the last book first
  started; round robin gives about the number of books.
- `first_start_wait_worst_s`: the longest wait from sending the regenerates to a book's first start.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from animastor_tasks.dev.celery_commands import celery_argv
from animastor_tasks.dev.supervisor import Supervisor, wait_until
from bench import rawchain
from bench.common import ROOT, BenchResult, Context, bench_env, drop_logs, make_runtime, pg_connect
from bench.farm import audio_stage, busy_fraction, events

SLOTS = 2
STEP_SECONDS = 0.15  # two builtin steps: a 0.3 s job
TARGET_BUSY = 0.95


def _stages() -> dict[str, object]:
    return {"audio": audio_stage(SLOTS, STEP_SECONDS, book_quota=1, window=1)}


def _book(book_id: str, scenes: int) -> dict[str, object]:
    return {
        "book_id": book_id,
        "title": book_id,
        "chapters": [
            {
                "chapter_id": "ch1",
                "title": "one",
                "scenes": [{"scene_id": f"s{i}", "text": f"{book_id} {i}", "prompt": "p"} for i in range(scenes)],
            }
        ],
    }


def _supervisor(folder: Path) -> Supervisor:
    env = {**os.environ, **bench_env(_stages()), "PYTHONPATH": ROOT, "ANIMASTOR_TICK_SECONDS": "1"}
    sup = Supervisor(env, folder, say=lambda _: None, cwd=Path(ROOT))
    sup.start(
        "control", celery_argv("worker", "-Q", "animastor.control", "-c", "2", "-n", "control@%h", "-l", "warning")
    )
    for i in range(SLOTS):
        sup.start(f"gpu{i}", celery_argv("worker", "-Q", "gpu.audio", "-c", "1", "-P", "solo", "-n", f"gpu{i}@%h"))
    sup.start("beat", celery_argv("beat", "-s", str(folder / "beat-schedule"), "-l", "warning"))
    return sup


def run(ctx: Context) -> BenchResult:
    from animastor_tasks.client import Client
    from animastor_tasks.config import Settings
    from animastor_tasks.domain.book_json import parse_book_json

    result = BenchResult()
    books, scenes = (30, 3) if ctx.quick else (40, 3)
    rt = make_runtime(_stages())
    ids = [f"busy{i:02d}" for i in range(books)]
    for book_id in ids:
        rt.catalog.import_book(parse_book_json(json.dumps(_book(book_id, scenes))))
    folder = Path(tempfile.mkdtemp(prefix="animastor-bench-lane-busy-"))
    workers = _supervisor(folder)
    client = Client(Settings.from_env(bench_env(_stages())))
    try:
        wait_until(
            lambda: (
                len(rt.presence.live_consumers(["gpu.audio"])["gpu.audio"]) == SLOTS
                and rt.presence.live_consumers(["animastor.control"])["animastor.control"]
            ),
            90,
            "worker presence",
            workers.check,
        )
        with pg_connect() as conn:
            sent = float(conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0])
        for book_id in ids:
            client.regenerate(book_id, ["audio"], wait=False)  # together: none waits for the one before
        total = books * scenes
        ctx.log(f"lane_busy: {books} books x {scenes} scenes on {SLOTS} slots, jobs {2 * STEP_SECONDS:.1f}s")

        def done() -> bool:
            with pg_connect() as conn:
                row = conn.execute("SELECT count(*) FROM asset_states WHERE state = 'ready'").fetchone()
            return int(row[0]) >= total

        wait_until(done, total * 2 * STEP_SECONDS + 120, "every pair ready", workers.check)
        rows = events(["dispatch", "job.started", "job.ready"])
    finally:
        client.close()
        workers.stop_all()
        rt.close()
    drop_logs(folder)

    raw = rawchain.measure([1] * SLOTS, total, 2 * STEP_SECONDS)
    result.figure(
        "lane_busy_fraction_raw_celery",
        raw.fraction,
        baseline=f"bare Celery on {SLOTS} single-process workers, the same jobs and window; each sends the next",
    )
    busy = busy_fraction(rows, SLOTS)
    busy.add_figures(result, "lane_busy_fraction", SLOTS, TARGET_BUSY, f"; bare Celery {raw.fraction:.3f}")
    started = [(book, at) for kind, book, _, _, at in rows if kind == "job.started"]
    first_index: dict[str, int] = {}
    first_at: dict[str, float] = {}
    for index, (book, at) in enumerate(started):
        first_index.setdefault(book, index)
        first_at.setdefault(book, at)
    worst_index = max(first_index.values())
    result.figure(
        "first_start_index_worst",
        worst_index,
        baseline=f"{books} books (round robin: about the number of books)",
        target=f"<= {books + SLOTS}",
        ok=worst_index <= books + SLOTS,
    )
    result.figure("first_start_wait_worst_s", max(first_at.values()) - sent, "s", baseline="capacity deferral 60 s")
    result.notes["jobs"] = sum(1 for kind, *_ in rows if kind == "job.ready")
    return result
