"""Shared plumbing for the benchmarks: throwaway stores, settings and stats.

Bulk loading is in `bench.seed`, round-trip counting in `bench.round_trips`.

Every benchmark runs against its own stores: the Postgres database `animastor_bench`
and Redis db 13 under the key prefix `bench` (also the Celery broker). `configure_environment`
must run before `animastor_tasks.worker.tasks` is imported: the Celery app reads the environment
at import time.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATABASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/animastor_bench")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
KEY_PREFIX = "bench"
STAGES = ("audio", "image")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------------------------------
# Environment and stores


ARTIFACT_ROOT = os.path.join("/tmp", f"animastor-bench-artifacts-{os.getuid()}")


def bench_env(stages: dict[str, Any] | None = None) -> dict[str, str]:
    """The ANIMASTOR_* variables pointing at the bench stores (optionally a custom stage table)."""
    env = {
        "ANIMASTOR_DATABASE_URL": DATABASE_URL,
        "ANIMASTOR_REDIS_URL": REDIS_URL,
        "ANIMASTOR_BROKER_URL": REDIS_URL,
        "ANIMASTOR_KEY_PREFIX": KEY_PREFIX,
        "ANIMASTOR_ARTIFACT_ROOT": ARTIFACT_ROOT,
    }
    if stages is not None:
        env["ANIMASTOR_STAGES"] = json.dumps(stages)
    return env


def configure_environment() -> None:
    """Point this process (and the workers it starts) at the bench stores; call before importing tasks."""
    for name in ("ANIMASTOR_STAGES",):
        os.environ.pop(name, None)
    os.environ.update(bench_env())


def stage_table(**limits: int) -> dict[str, Any]:
    """The default two stages with the given limits (lane_limit, book_quota, window, lease_ttl)."""
    return {
        "audio": {"queue": "gpu.audio", "input": "text", "media_type": "audio/wav", **limits},
        "image": {"queue": "gpu.image", "input": "prompt", "media_type": "image/png", **limits},
    }


def prepare_stores() -> None:
    """Create and migrate the bench database (idempotent)."""
    from animastor_tasks.adapters.postgres.migrations import migrate
    from animastor_tasks.adapters.postgres.pool import Database
    from animastor_tasks.dev.probes import ensure_database

    ensure_database(DATABASE_URL)
    db = Database(DATABASE_URL)
    try:
        migrate(db)
    finally:
        db.close()


def reset_stores() -> None:
    """TRUNCATE every product table of the bench database and FLUSHDB the bench Redis db, leaving reconcile's bookmark
    as a running farm's Redis holds it: without it, the first tick rebuilds every book with work (flow/rebuild.py).
    The bench jobs' media goes too (kept, each run added its jobs' files)."""
    import psycopg
    import redis

    from animastor_tasks.domain.keys import Keyspace
    from animastor_tasks.flow.rebuild import BOOKMARK

    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT quote_ident(tablename) FROM pg_tables WHERE schemaname = 'public'"
                " AND tablename <> 'schema_migrations'"
            )
        ]
        if tables:
            conn.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.flushdb()
        client.set(Keyspace(KEY_PREFIX).bookmark(BOOKMARK), "")
    finally:
        client.close()
    shutil.rmtree(ARTIFACT_ROOT, ignore_errors=True)
    declare_broker_queues()


def declare_broker_queues() -> None:
    """Declare animastor's queues again after a FLUSHDB (kombu's Redis transport keeps bindings in keys).

    A producer remembers what it declared, so without this a message published after a
    flush would find no binding and never reach its queue's list.
    """
    from animastor_tasks.worker.app import app

    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for queue in app.amqp.queues.values():
            queue.bind(channel).declare()


def make_runtime(stages: dict[str, Any] | None = None) -> Any:
    """The wiring on the bench stores, publishing real Celery messages to the bench broker."""
    from animastor_tasks.config import Settings
    from animastor_tasks.worker.wiring import build

    return build(Settings.from_env(bench_env(stages)))


def drop_logs(folder: Path, failed: type[BaseException] | None = None) -> None:
    """A benchmark's worker logs: removed once it is done with them (each run left a folder in /tmp), kept and named
    when it failed."""
    if failed is None:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"   worker logs kept in {folder}", file=sys.stderr, flush=True)


def pg_connect(autocommit: bool = True) -> Any:
    import psycopg

    return psycopg.connect(DATABASE_URL, autocommit=autocommit)


# ---------------------------------------------------------------------------------------------------------------------
# Bulk loading (COPY, text format; every id here is plain ASCII, so nothing needs escaping)


def purge_queues(queues: Sequence[str]) -> None:
    """Drop the queued messages of broker queues (kombu's Redis transport: one list per queue and priority)."""
    client = redis_client()
    try:
        for queue in queues:
            keys = [k for k in client.scan_iter(match=f"{queue}*") if k == queue or k.startswith(queue + "\x06")]
            if keys:
                client.delete(*keys)
    finally:
        client.close()


SENTINEL = f"{KEY_PREFIX}:bench-sentinel"


def plant_sentinel() -> None:
    """A key of ours in the bench Redis db: gone later means someone emptied Redis (FLUSHALL) meanwhile."""
    client = redis_client()
    try:
        client.set(SENTINEL, "1")
    finally:
        client.close()


def sentinel_alive() -> bool:
    client = redis_client()
    try:
        return bool(client.exists(SENTINEL))
    finally:
        client.close()


def analyze() -> None:
    with pg_connect() as conn:
        conn.execute("ANALYZE")


def redis_client() -> Any:
    import redis

    return redis.Redis.from_url(REDIS_URL, decode_responses=True)


# ---------------------------------------------------------------------------------------------------------------------
# Round trips


# ---------------------------------------------------------------------------------------------------------------------
# Stats and results


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (pct in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(pct / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


@dataclass
class Row:
    """One line of the printed table."""

    name: str
    value: float | int | str
    unit: str = ""
    baseline: str = ""
    target: str = ""
    verdict: str = ""


@dataclass
class BenchResult:
    figures: dict[str, float | int] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def figure(
        self,
        name: str,
        value: float | int,
        unit: str = "",
        *,
        baseline: str = "",
        target: str = "",
        ok: bool | None = None,
    ) -> None:
        self.figures[name] = round(value, 3) if isinstance(value, float) else value
        self.rows.append(Row(name, self.figures[name], unit, baseline, target, "" if ok is None else verdict(ok)))

    def ms_within(self, name: str, value: float, baseline: float, what: str, most: float, note: str = "") -> None:
        """A time in ms whose target is at most `most` times a baseline measured in the same run."""
        ratio = value / baseline
        self.figure(
            name,
            value,
            "ms",
            baseline=f"{what} {baseline:.2f} ms (x{ratio:.2f}){note}",
            target=f"<= {most:g}x",
            ok=ratio <= most,
        )


@dataclass(frozen=True)
class Context:
    quick: bool = False

    def log(self, message: str) -> None:
        print(f"  [{time.strftime('%H:%M:%S')}] {message}", flush=True)


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process from /proc/<pid>/stat, or None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def redis_cpu_seconds() -> float:
    """CPU the whole Redis server has used (INFO cpu): every client's work, not only ours."""
    client = redis_client()
    try:
        info = client.info("cpu")
    finally:
        client.close()
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
