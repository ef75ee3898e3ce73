"""Shared plumbing for the benchmarks: throwaway stores, bulk loading, round-trip counters, stats.

Every benchmark runs against its own stores: the Postgres database `animastor_bench`
and Redis db 13 under the key prefix `bench` (also the Celery broker). `configure_environment`
must run before `animastor_tasks.worker.tasks` is imported: the Celery app reads the environment
at import time.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

DATABASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/animastor_bench")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
KEY_PREFIX = "bench"
STAGES = ("audio", "image")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------------------------------
# Environment and stores


def bench_env(stages: dict[str, Any] | None = None) -> dict[str, str]:
    """The ANIMASTOR_* variables pointing at the bench stores (optionally a custom stage table)."""
    env = {
        "ANIMASTOR_DATABASE_URL": DATABASE_URL,
        "ANIMASTOR_REDIS_URL": REDIS_URL,
        "ANIMASTOR_BROKER_URL": REDIS_URL,
        "ANIMASTOR_KEY_PREFIX": KEY_PREFIX,
        "ANIMASTOR_ARTIFACT_ROOT": os.path.join("/tmp", f"animastor-bench-artifacts-{os.getuid()}"),
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
    """TRUNCATE every product table of the bench database and FLUSHDB the bench Redis db."""
    import psycopg
    import redis

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
    finally:
        client.close()
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


def pg_connect(autocommit: bool = True) -> Any:
    import psycopg

    return psycopg.connect(DATABASE_URL, autocommit=autocommit)


# ---------------------------------------------------------------------------------------------------------------------
# Bulk loading (COPY, text format; every id here is plain ASCII, so nothing needs escaping)


def scene_key(index: int, scenes_per_chapter: int) -> tuple[str, str]:
    """(chapter, scene) of the index-th scene of a book, in reading order."""
    return f"ch{index // scenes_per_chapter:05d}", f"sc{index:07d}"


@dataclass(frozen=True)
class BookShape:
    book_id: str
    scenes: int
    scenes_per_chapter: int = 500

    def keys(self) -> list[tuple[str, str]]:
        return [scene_key(i, self.scenes_per_chapter) for i in range(self.scenes)]


StateOf = Callable[[str, int, str], str]


def _copy(cur: Any, table: str, columns: Sequence[str], lines: Iterable[str], chunk: int = 20_000) -> int:
    count = 0
    with cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        buf = io.StringIO()
        pending = 0
        for line in lines:
            buf.write(line)
            pending += 1
            if pending >= chunk:
                copy.write(buf.getvalue())
                buf = io.StringIO()
                count += pending
                pending = 0
        if pending:
            copy.write(buf.getvalue())
            count += pending
    return count


def load_books(
    shapes: Sequence[BookShape],
    state_of: StateOf,
    stages: Sequence[str] = STAGES,
    *,
    layer_config: str | None = None,
) -> dict[str, int]:
    """COPY books, chapters, scenes and one asset row per scene x stage; FK triggers off while loading.

    `state_of(book, scene_index, stage)` gives each pair's state; `generating` rows get a
    dispatch id and token 1, `ready` rows an input hash and artifact digest.
    """
    counts = {"books": 0, "chapters": 0, "scenes": 0, "asset_states": 0}
    layers = "\\N" if layer_config is None else layer_config
    with pg_connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("SET LOCAL session_replication_role = replica")
        counts["books"] = _copy(
            cur,
            "books",
            ("book_id", "title", "layer_config"),
            (f"{s.book_id}\t{s.book_id}\t{layers}\n" for s in shapes),
        )

        def chapters() -> Iterator[str]:
            for s in shapes:
                n = (s.scenes + s.scenes_per_chapter - 1) // s.scenes_per_chapter
                for c in range(n):
                    yield f"{s.book_id}\tch{c:05d}\t{c}\n"

        counts["chapters"] = _copy(cur, "chapters", ("book_id", "chapter_id", "position"), chapters())

        def scenes() -> Iterator[str]:
            for s in shapes:
                for i in range(s.scenes):
                    chapter, scene = scene_key(i, s.scenes_per_chapter)
                    yield f"{s.book_id}\t{chapter}\t{scene}\t{i}\tscene {i} text\tscene {i} prompt\t{{}}\n"

        counts["scenes"] = _copy(
            cur, "scenes", ("book_id", "chapter_id", "scene_id", "position", "text", "prompt", "input_hashes"), scenes()
        )

        def assets() -> Iterator[str]:
            for s in shapes:
                for i in range(s.scenes):
                    chapter, scene = scene_key(i, s.scenes_per_chapter)
                    for stage in stages:
                        state = state_of(s.book_id, i, stage)
                        if state == "generating":
                            extra = f"1\t{uuid.uuid4().hex}\t\\N\t\\N"
                        elif state == "ready":
                            extra = "0\t\\N\th0\ta0"
                        else:
                            extra = "0\t\\N\t\\N\t\\N"
                        yield f"{s.book_id}\t{chapter}\t{scene}\t{stage}\t{state}\t{extra}\n"

        counts["asset_states"] = _copy(
            cur,
            "asset_states",
            (
                "book_id",
                "chapter_id",
                "scene_id",
                "stage",
                "state",
                "fencing_token",
                "dispatch_id",
                "input_hash",
                "artifact_sha256",
            ),
            assets(),
        )
        conn.commit()
    return counts


def add_command(book: str, stage: str, scenes: Sequence[tuple[str, str]], status: str = "active") -> str:
    """One command (COPY of its targets) covering `scenes` for `stage`; returns its id."""
    command_id = str(uuid.uuid4())
    with pg_connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute(
            "INSERT INTO commands (command_id, book_id, stage, status, force, request_id)"
            " VALUES (%s, %s, %s, %s, true, %s)",
            (command_id, book, stage, status, str(uuid.uuid4())),
        )
        cur.execute("SET LOCAL session_replication_role = replica")
        _copy(
            cur,
            "command_targets",
            ("command_id", "book_id", "chapter_id", "scene_id", "stage"),
            (f"{command_id}\t{book}\t{c}\t{s}\t{stage}\n" for c, s in scenes),
        )
        conn.commit()
    return command_id


def add_commands_bulk(shapes: Sequence[BookShape], stages: Sequence[str] = STAGES) -> int:
    """One active command per book and stage covering every scene, for many books in two COPYs."""
    ids = {(s.book_id, stage): str(uuid.uuid4()) for s in shapes for stage in stages}
    with pg_connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("SET LOCAL session_replication_role = replica")
        _copy(
            cur,
            "commands",
            ("command_id", "book_id", "stage", "status", "force", "request_id"),
            (f"{cid}\t{book}\t{stage}\tactive\tt\t{uuid.uuid4()}\n" for (book, stage), cid in ids.items()),
        )

        def targets() -> Iterator[str]:
            for s in shapes:
                scenes = s.keys()
                for stage in stages:
                    cid = ids[(s.book_id, stage)]
                    for c, sc in scenes:
                        yield f"{cid}\t{s.book_id}\t{c}\t{sc}\t{stage}\n"

        count = _copy(cur, "command_targets", ("command_id", "book_id", "chapter_id", "scene_id", "stage"), targets())
        conn.commit()
    return count


def start_work(rt: Any, shapes: Sequence[BookShape], stages: Sequence[str] = STAGES) -> None:
    """What a regenerate of every scene does after its Postgres side, book by book: the Redis side
    (the port it calls), then its gate pass without dispatch (`schedule`)."""
    for s in shapes:
        keys = s.keys()
        for start in range(0, len(keys), 10_000):
            chunk = keys[start : start + 10_000]
            pairs = [(c, sc, stage) for c, sc in chunk for stage in stages]
            rt.ports.book_state.start_work(s.book_id, pairs, chunk, force_ttl=None)
        schedule(rt, s.book_id)


def schedule(rt: Any, book: str) -> None:
    """The gate pass a regenerate runs next, without its dispatch (`dispatch_work=False`, as after a
    layer change): whatever index of books with work the design keeps, the book is in it as a
    regenerate leaves it, and nothing is dispatched while the benchmark sets up."""
    from animastor_tasks.flow.gate import gate_pass

    gate_pass(rt.ports, book, dispatch_work=False)


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


def add_deferrals(rt: Any, book: str, pairs: Sequence[tuple[str, str, str]], bucket: str, seconds: float) -> None:
    """Deferrals for `pairs` in one bucket, in batches of 10k members."""
    now = time.time()
    for start in range(0, len(pairs), 10_000):
        rt.deferrals.defer(book, bucket, pairs[start : start + 10_000], seconds, now)


def activate(rt: Any, book: str, scenes: Sequence[tuple[str, str]]) -> None:
    for start in range(0, len(scenes), 10_000):
        rt.ports.book_state.activate(book, scenes[start : start + 10_000])


def advertise_consumers(rt: Any, queues: Sequence[str], ttl: float = 600.0) -> None:
    """A fake live consumer on each queue, so dispatch is not BLOCKED (nothing consumes for real)."""
    rt.presence.heartbeat("bench@host", list(queues), ttl)


# ---------------------------------------------------------------------------------------------------------------------
# Round trips


@dataclass
class RoundTrips:
    """Round trips seen through one runtime: Redis commands and pipelines, Postgres statements."""

    redis_commands: int = 0
    redis_pipelines: int = 0
    pg_statements: int = 0
    pg_transactions: int = 0
    backend_pids: set[int] = field(default_factory=set)
    statement_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def redis(self) -> int:
        return self.redis_commands + self.redis_pipelines

    @property
    def total(self) -> int:
        return self.redis + self.pg_statements

    @property
    def wire_total(self) -> int:
        """Also the pool's connection check, BEGIN and COMMIT of each transaction (one round trip each)."""
        return self.total + 3 * self.pg_transactions

    def describe(self) -> str:
        return (
            f"redis {self.redis_commands} cmd + {self.redis_pipelines} pipeline, "
            f"pg {self.pg_statements} stmt in {self.pg_transactions} tx "
            f"(= {self.total}; {self.wire_total} counting pool check/BEGIN/COMMIT)"
        )

    def _timed(self, sql: Any, seconds: float) -> None:
        text = sql.decode() if isinstance(sql, bytes) else str(sql)
        key = " ".join(text.split())[:110]
        self.statement_seconds[key] = self.statement_seconds.get(key, 0.0) + seconds


class _CountingCursor:
    def __init__(self, cur: Any, counter: RoundTrips) -> None:
        self._cur = cur
        self._counter = counter

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        self._counter.pg_statements += 1
        started = time.perf_counter()
        try:
            return self._cur.execute(query, *args, **kwargs)
        finally:
            self._counter._timed(query, time.perf_counter() - started)

    def executemany(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        self._counter.pg_statements += 1
        return self._cur.executemany(query, *args, **kwargs)

    def __enter__(self) -> _CountingCursor:
        self._cur.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._cur.__exit__(*exc)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._cur)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _CountingConnection:
    def __init__(self, conn: Any, counter: RoundTrips) -> None:
        self._conn = conn
        self._counter = counter
        counter.backend_pids.add(conn.info.backend_pid)

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        self._counter.pg_statements += 1
        started = time.perf_counter()
        try:
            cur = self._conn.execute(query, *args, **kwargs)
            # Rows are fetched eagerly by psycopg's client-side cursor: the time is the statement's.
            return cur
        finally:
            self._counter._timed(query, time.perf_counter() - started)

    def cursor(self, *args: Any, **kwargs: Any) -> _CountingCursor:
        return _CountingCursor(self._conn.cursor(*args, **kwargs), self._counter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@contextmanager
def count_round_trips(rt: Any) -> Iterator[RoundTrips]:
    """Count what goes through `rt.redis.client`, `rt.db.transaction()` and `rt.db.read()` while the block runs.

    Redis: every `execute_command` (scripts included) and every pipeline `execute`.
    Postgres: every `conn.execute` / cursor execute inside a `Database.transaction()` or `read()`,
    plus the transactions themselves (each also costs a BEGIN and a COMMIT round trip
    and the pool's connection check, not included in `pg_statements`).
    """
    counter = RoundTrips()
    client = rt.redis.client
    original_execute = client.execute_command
    original_pipeline = client.pipeline

    def execute_command(*args: Any, **kwargs: Any) -> Any:
        counter.redis_commands += 1
        return original_execute(*args, **kwargs)

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = original_pipeline(*args, **kwargs)
        run = pipe.execute

        def execute(*eargs: Any, **ekwargs: Any) -> Any:
            counter.redis_pipelines += 1
            return run(*eargs, **ekwargs)

        pipe.execute = execute
        return pipe

    db = rt.db
    original_transaction = db.transaction
    original_read = db.read

    @contextmanager
    def transaction() -> Iterator[Any]:
        counter.pg_transactions += 1
        with original_transaction() as conn:
            yield _CountingConnection(conn, counter)

    @contextmanager
    def read() -> Iterator[Any]:
        # Autocommit: the statement is the only round trip (no BEGIN/COMMIT).
        with original_read() as conn:
            yield _CountingConnection(conn, counter)

    client.execute_command = execute_command
    client.pipeline = pipeline
    db.transaction = transaction
    db.read = read
    try:
        yield counter
    finally:
        del client.execute_command
        del client.pipeline
        del db.transaction
        del db.read


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
