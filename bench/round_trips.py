"""Counting the round trips a pass makes to Postgres and Redis, for the gate benchmarks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


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

    def add(self, other: RoundTrips) -> None:
        """Count `other`'s round trips too (several counted stretches reported as one)."""
        self.redis_commands += other.redis_commands
        self.redis_pipelines += other.redis_pipelines
        self.pg_statements += other.pg_statements
        self.pg_transactions += other.pg_transactions

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
