"""A small farm of real Celery processes on the bench stores, for the end-to-end benchmarks.

One control worker (as `animastor-tasks worker` runs it: prefork, 2 processes), beat, and the
GPU workers asked for, all started with `animastor_tasks.dev.supervisor` on a stage table of the
benchmark's own (ANIMASTOR_STAGES). Helpers read the journal (`events`) on the database clock.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from animastor_tasks.dev.celery_commands import celery_argv
from animastor_tasks.dev.supervisor import Supervisor, wait_until
from bench.common import ROOT, BenchResult, bench_env, drop_logs, make_runtime, pg_connect, proc_cpu_seconds


def audio_stage(slots: int, step_seconds: float, **extra: Any) -> dict[str, Any]:
    """The audio stage the farm benchmarks share: builtin jobs of two steps on `slots` slots."""
    return {
        "queue": "gpu.audio",
        "input": "text",
        "media_type": "audio/wav",
        "lane_limit": slots,
        **extra,
        "params": {"steps": 2, "step_seconds": step_seconds},
    }


def book_json(book_id: str, scenes: int) -> str:
    """A one-chapter book of `scenes` scenes, for `catalog.import_book`."""
    chapter = {
        "chapter_id": "ch1",
        "title": "one",
        "scenes": [{"scene_id": f"s{i:04d}", "text": f"{book_id} {i}", "prompt": "p"} for i in range(scenes)],
    }
    return json.dumps({"book_id": book_id, "title": book_id, "chapters": [chapter]})


class Farm:
    """Control worker, beat and GPU workers (`gpu`: (queue, processes) per worker) on `stages`."""

    def __init__(self, stages: dict[str, Any], gpu: Sequence[tuple[str, int]], *, tick_seconds: float = 5.0) -> None:
        from animastor_tasks.client import Client
        from animastor_tasks.config import Settings

        self.stages = stages
        self.rt = make_runtime(stages)
        self.folder = Path(tempfile.mkdtemp(prefix="animastor-bench-farm-"))
        env = {
            **os.environ,
            **bench_env(stages),
            "PYTHONPATH": ROOT,
            "ANIMASTOR_TICK_SECONDS": str(tick_seconds),
        }
        self.sup = Supervisor(env, self.folder, say=lambda _: None, cwd=Path(ROOT))
        self.client = Client(Settings.from_env(bench_env(stages)))
        self.gpu = list(gpu)

    def import_books(self, books: dict[str, int]) -> None:
        from animastor_tasks.domain.book_json import parse_book_json

        for book_id, scenes in books.items():
            self.rt.catalog.import_book(parse_book_json(book_json(book_id, scenes)))

    def start(self) -> None:
        control = ("worker", "-Q", "animastor.control", "-c", "2", "-n", "control@%h", "-l", "warning")
        self.sup.start("control", celery_argv(*control, "--without-gossip", "--without-mingle"))
        for i, (queue, procs) in enumerate(self.gpu):
            argv = ("worker", "-Q", queue, "-c", str(procs), "--prefetch-multiplier", "1", "-n", f"gpu{i}@%h")
            pool = ("-P", "solo") if procs == 1 else ("-O", "fair")
            quiet = ("-l", "warning", "--without-gossip", "--without-mingle")
            self.sup.start(f"gpu{i}", celery_argv(*argv, *pool, *quiet))
        self.sup.start("beat", celery_argv("beat", "-s", str(self.folder / "beat-schedule"), "-l", "warning"))
        queues = sorted({q for q, _ in self.gpu} | {"animastor.control"})

        def present() -> bool:
            live = self.rt.presence.live_consumers(queues)
            return all(live[q] for q in queues)

        wait_until(present, 120, "worker presence", self.sup.check)

    def control_cpu_seconds(self) -> float:
        """CPU (user + system) of the control worker, its pool processes and beat, so far."""
        return self.cpu_seconds(("control", "beat"))

    def gpu_cpu_seconds(self) -> float:
        """CPU of the GPU workers and their pool processes, so far."""
        return self.cpu_seconds(tuple(f"gpu{i}" for i in range(len(self.gpu))))

    def cpu_seconds(self, names: Sequence[str]) -> float:
        total = 0.0
        for name in names:
            pid = self.sup.children[name].pid
            for p in (pid, *_children(pid)):
                total += proc_cpu_seconds(p) or 0.0
        return total

    def __enter__(self) -> Farm:
        return self

    def __exit__(self, failed: type[BaseException] | None, *_: object) -> None:
        """Stopped; the workers' logs removed, or kept for a look when the benchmark failed."""
        try:
            self.client.close()
        finally:
            self.sup.stop_all()
            self.rt.close()
        drop_logs(self.folder, failed)


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc/<pid>/task/*/children)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as handle:
                kids = [int(k) for k in handle.read().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *_children(kid)]
    return out


def db_now() -> float:
    with pg_connect() as conn:
        return float(conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0])


def events(kinds: Sequence[str], books: Sequence[str] | None = None) -> list[tuple[str, str, str, str, float]]:
    """(kind, book, scene, dispatch_id, at) of the journal's events of `kinds`, oldest first."""
    sql = (
        "SELECT kind, book_id, coalesce(scene_id, ''), coalesce(dispatch_id, ''), extract(epoch FROM at)"
        " FROM events WHERE kind = ANY(%s)"
    )
    params: list[Any] = [list(kinds)]
    if books is not None:
        sql += " AND book_id = ANY(%s)"
        params.append(list(books))
    with pg_connect() as conn:
        rows = conn.execute(sql + " ORDER BY at, id", params).fetchall()
    return [(k, b, s, d, float(at)) for k, b, s, d, at in rows]


def count_state(state: str, books: Sequence[str] | None = None) -> int:
    sql = "SELECT count(*) FROM asset_states WHERE state = %s"
    params: list[Any] = [state]
    if books is not None:
        sql += " AND book_id = ANY(%s)"
        params.append(list(books))
    with pg_connect() as conn:
        return int(conn.execute(sql, params).fetchone()[0])


def wait_ready(farm: Farm, books: Sequence[str], total: int, timeout: float) -> None:
    """Until `total` pairs of `books` are ready (the farm's children checked meanwhile)."""
    wait_until(lambda: count_state("ready", books) >= total, timeout, f"{total} pairs ready", farm.sup.check)


@dataclass(frozen=True)
class Busy:
    """How busy a lane's slots were (journal events `dispatch`, `job.started`, `job.ready`)."""

    fraction: float  # from the first dispatch until the backlog is empty (the last job started)
    span: float
    to_last_end: float  # from the first start to the last end: also the tail, when no work waited
    span_to_last_end: float

    def add_figures(self, result: BenchResult, name: str, slots: int, target: float, baseline: str = "") -> None:
        """`name` (the issue's window, with its target) and `name`_to_last_end beside it."""
        result.figure(
            name,
            self.fraction,
            baseline=f"{slots} slots x {self.span:.1f}s from the first dispatch to the last start{baseline}",
            target=f">= {target}",
            ok=self.fraction >= target,
        )
        result.figure(
            f"{name}_to_last_end",
            self.to_last_end,
            baseline=f"{slots} slots x {self.span_to_last_end:.1f}s, first start to last end (the tail included)",
        )


def busy_fraction(rows: Sequence[tuple[str, str, str, str, float]], slots: int) -> Busy:
    """Busy slot-seconds (job.started -> job.ready) over available slot-seconds, in two windows.

    The issue's window runs from the first dispatch until the backlog is empty: once the last pair has
    started no work waits, and the slots that finish before the last job are idle for want of work, not
    for want of dispatch. The older window (first start to last end) is kept beside it.
    """
    starts = {d: at for kind, _, _, d, at in rows if kind == "job.started"}
    ends = {d: at for kind, _, _, d, at in rows if kind == "job.ready"}
    first = min(at for kind, _, _, _, at in rows if kind == "dispatch")
    empty = max(starts.values())
    busy = sum(max(0.0, min(ends[d], empty) - max(starts[d], first)) for d in ends if d in starts)
    whole = sum(ends[d] - starts[d] for d in ends if d in starts)
    span, span_to_end = empty - first, max(ends.values()) - min(starts.values())
    return Busy(busy / (slots * span), span, whole / (slots * span_to_end), span_to_end)
