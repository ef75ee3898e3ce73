"""Postgres connection pool and versioned migrations.

A pool belongs to one process: after a fork (Celery prefork children) the child
builds its own on first use, so no connection ever crosses a fork. Driver errors
become `StoreUnavailable` here, at the edge.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from animastor_tasks.errors import StoreUnavailable

log = logging.getLogger("animastor.postgres")

_MIGRATIONS_LOCK_ID = 0x616E696D  # advisory lock taken while migrating


def _is_store_error(err: BaseException) -> bool:
    return isinstance(err, psycopg.OperationalError | psycopg.InterfaceError | PoolTimeout)


class Database:
    def __init__(self, url: str, *, max_size: int = 8, timeout: float = 5.0) -> None:
        self.url = url
        self._max_size = max_size
        self._timeout = timeout
        self._pool: ConnectionPool | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def _get_pool(self) -> ConnectionPool:
        pid = os.getpid()
        if self._pool is None or self._pid != pid:
            with self._lock:
                if self._pool is None or self._pid != pid:
                    # A pool inherited across fork is abandoned, never used or closed here.
                    self._pool = ConnectionPool(
                        self.url,
                        min_size=0,
                        max_size=self._max_size,
                        timeout=self._timeout,
                        open=True,
                        kwargs={"connect_timeout": max(1, int(self._timeout)), "autocommit": False},
                        # No ping per checkout (a round trip on every transaction): a connection that
                        # died is discarded when its transaction fails, and idle ones are recycled.
                        max_idle=60,
                        reconnect_timeout=self._timeout,
                    )
                    self._pid = pid
        return self._pool

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        """One transaction: committed when the block ends, rolled back on error."""
        with self._connection(autocommit=False) as conn:
            yield conn

    @contextmanager
    def read(self) -> Iterator[psycopg.Connection]:
        """For one read-only statement: no BEGIN/COMMIT round trips around it."""
        with self._connection(autocommit=True) as conn:
            yield conn

    @contextmanager
    def _connection(self, *, autocommit: bool) -> Iterator[psycopg.Connection]:
        try:
            with self._get_pool().connection() as conn:
                if conn.autocommit != autocommit:
                    conn.autocommit = autocommit
                yield conn
        except psycopg.Error as err:
            if _is_store_error(err):
                raise StoreUnavailable("postgres", self.url, str(err).strip() or type(err).__name__) from err
            raise
        except PoolTimeout as err:
            raise StoreUnavailable("postgres", self.url, f"no connection within {self._timeout}s") from err

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.close()
        self._pool = None

    def ping(self) -> None:
        with self.transaction() as conn:
            conn.execute("SELECT 1")


def migration_files() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every migration shipped with the package, in order."""
    folder = resources.files("animastor_tasks.adapters.postgres") / "sql"
    found = []
    for entry in folder.iterdir():
        name = entry.name
        if name.endswith(".sql") and name[:4].isdigit():
            found.append((int(name[:4]), name, entry.read_text(encoding="utf-8")))
    return sorted(found)


def migrate(db: Database) -> list[str]:
    """Apply the migrations a database lacks; safe to run again and concurrently."""
    applied: list[str] = []
    with db.transaction() as conn:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATIONS_LOCK_ID,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
        for version, name, sql in migration_files():
            if version in done:
                continue
            conn.execute(sql.encode())
            conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (version, name))
            applied.append(name)
            log.info("[DB] applied migration %s", name)
    return applied
