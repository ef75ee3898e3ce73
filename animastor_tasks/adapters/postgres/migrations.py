"""Versioned schema migrations shipped as `sql/NNNN_name.sql`."""

from __future__ import annotations

import itertools
import logging
import time
from importlib import resources
from importlib.resources.abc import Traversable

import psycopg

from animastor_tasks.adapters.postgres.pool import (
    Database,
    _Connection,
    _dead_peer_defaults,
    _is_store_error,
    answering_within,
)
from animastor_tasks.errors import AnimastorError, StoreUnavailable

log = logging.getLogger("animastor.postgres")

_MIGRATIONS_LOCK_ID = 0x616E696D  # advisory lock taken while migrating
LOCK_WAIT_SECONDS = 60.0  # how long a migration tries to get its table locks before it gives up
ATTEMPT_LOCK_TIMEOUT_MS = 1000  # one try's wait for a lock: what the traffic queued behind it waits at most
_PAUSE_BETWEEN_ATTEMPTS_S = 0.5  # the queued traffic runs meanwhile


class MigrationFailed(AnimastorError):
    """A migration that cannot be applied as shipped: its own SQL failed, or two files share a version. Not the
    store being unavailable (exit 3, "try again"): running `db migrate` again fails the same way."""


def _folder() -> Traversable:
    return resources.files("animastor_tasks.adapters.postgres") / "sql"


def migration_files() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every migration shipped with the package, in order.

    Two files of one version are refused: only the version is recorded, so the second was skipped for ever once
    the first was in (a file left behind by an install copied over an older one, a merge of two branches)."""
    found = []
    for entry in _folder().iterdir():
        name = entry.name
        if name.endswith(".sql") and name[:4].isdigit():
            found.append((int(name[:4]), name, entry.read_text(encoding="utf-8")))
    found.sort()
    for (version, first, _), (other, second, _) in itertools.pairwise(found):
        if version == other:
            raise MigrationFailed(
                f"migrations {first} and {second} share version {version:04d}: only one of them would ever be"
                f" applied. Remove the stray file from {_folder()} (or renumber one) before migrating"
            )
    return found


def missing_migrations(url: str, within: float) -> list[str] | None:
    """The migrations this release ships that the database at `url` lacks (every one when it was never migrated),
    as `migrate` judges them (by version, a gap too); None when it does not answer within `within` seconds, its
    connect and its answer each bounded (a hung proxy, a frozen server): it may come back migrated."""
    try:
        with _Connection.connect(url, connect_timeout=max(1, round(within)), **_dead_peer_defaults(url)) as conn:
            conn.answer_limit = within
            try:
                done = {int(version) for (version,) in conn.execute("SELECT version FROM schema_migrations")}
            except psycopg.errors.UndefinedTable:
                done = set()
    except psycopg.Error:
        return None
    return [name for version, name, _ in migration_files() if version not in done]


def migrate(db: Database, lock_wait: float = LOCK_WAIT_SECONDS) -> list[str]:
    """Apply the migrations a database lacks; safe to run again and concurrently.

    Each migration commits on its own, so a table one of them locks is free again before the next
    starts (one transaction for all held 0006's lock on `asset_states` through every later one). A
    session advisory lock, held across them, makes a second migrate wait and then find nothing to do.
    A migration tries for its table locks a second at a time for up to `lock_wait` seconds, then gives up
    (`StoreUnavailable`, naming the open transactions), having applied nothing of itself; a migrate waits as
    long for the advisory lock, then gives up naming the session that holds it.
    """
    applied: list[str] = []
    with db.read() as conn, answering_within(conn, None):
        _take_migration_lock(db, conn, lock_wait)
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
            for version, name, sql in migration_files():
                if version in done:
                    continue
                _apply(db, conn, version, name, sql, lock_wait)
                applied.append(name)
                log.info("[DB] applied migration %s", name)
        finally:
            if not conn.broken:
                conn.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATIONS_LOCK_ID,))
    return applied


def _take_migration_lock(db: Database, conn: psycopg.Connection, lock_wait: float) -> None:
    """The advisory lock, tried until `lock_wait` has passed. *Why:* `pg_advisory_lock` waited without bound and
    without a word (no lock timeout is set yet): behind a migrate stuck on something else, or a session that took
    the lock and stayed, `db migrate` hung silently."""
    deadline = time.monotonic() + lock_wait
    said = False
    while not _try_migration_lock(conn):
        if time.monotonic() >= deadline:
            raise StoreUnavailable(
                "postgres",
                db.url,
                f"another session held the migration lock (advisory lock {_MIGRATIONS_LOCK_ID}) all the {lock_wait:g}s"
                f" this migrate waited;"
                f" nothing was applied. Held by: {_lock_holders(conn)}. Wait for that migrate to end (or end the"
                " session), then run `animastor-tasks db migrate` again",
            )
        if not said:
            log.warning("[DB] waiting for the migration lock, held by %s", _lock_holders(conn))
            said = True
        time.sleep(_PAUSE_BETWEEN_ATTEMPTS_S)


def _try_migration_lock(conn: psycopg.Connection) -> bool:
    row = conn.execute("SELECT pg_try_advisory_lock(%s)", (_MIGRATIONS_LOCK_ID,)).fetchone()
    return bool(row and row[0])


def _lock_holders(conn: psycopg.Connection) -> str:
    rows = conn.execute(
        "SELECT a.pid, coalesce(nullif(a.application_name, ''), a.usename::text, '?'), coalesce(a.state, '?'),"
        " round(extract(epoch FROM now() - a.backend_start))::int, left(coalesce(a.query, ''), 80)"
        " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.database = (SELECT oid FROM pg_database"
        " WHERE datname = current_database()) AND l.classid = 0 AND l.objid = %s AND l.objsubid = 1",
        (_MIGRATIONS_LOCK_ID,),
    ).fetchall()
    if not rows:
        return "nobody now"
    return "; ".join(
        f"pid {pid} ({app}, {state}, connected {age}s ago: {query!r})" for pid, app, state, age, query in rows
    )


def _apply(db: Database, conn: psycopg.Connection, version: int, name: str, sql: str, lock_wait: float) -> None:
    """One migration in its own transaction, its lock waits cut short and tried again. *Why:* waiting for a
    table's lock behind a transaction left open (a psql session idle in one, a stuck report), the migration
    held up every statement on that table queued behind its own request, for as long as that transaction
    stayed open: the whole runtime stood still while the upgrade looked merely slow."""
    deadline = time.monotonic() + lock_wait
    while True:
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = '{ATTEMPT_LOCK_TIMEOUT_MS}ms'")
                conn.execute(sql.encode())
                conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (version, name))
            return
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected):  # a try cut short: none of it
            if time.monotonic() >= deadline:
                raise StoreUnavailable(
                    "postgres",
                    db.url,
                    f"migration {name} could not lock its tables within {lock_wait:g}s; nothing of it was applied."
                    f" Open transactions, oldest first: {_open_transactions(conn)}. End them (or wait for them),"
                    " then run `animastor-tasks db migrate` again",
                ) from None
            log.warning("[DB] migration %s waits for a table lock another transaction holds; trying again", name)
            time.sleep(_PAUSE_BETWEEN_ATTEMPTS_S)
        except psycopg.Error as err:
            if _is_store_error(err):
                raise  # the pool says Postgres is unavailable
            # Raised past the pool, which took a missing table or column for a database behind this release and
            # said to run `db migrate`: the very command that failed.
            raise MigrationFailed(
                f"migration {name} failed{_where(sql, err)}: {_server_says(err)}. Nothing of it was applied (those"
                " before it were); fix the cause, then run `animastor-tasks db migrate` again"
            ) from err


def _where(sql: str, err: psycopg.Error) -> str:
    position = err.diag.statement_position
    return f" at line {sql[: int(position) - 1].count(chr(10)) + 1}" if position and position.isdigit() else ""


def _server_says(err: psycopg.Error) -> str:
    diag = err.diag
    said = diag.message_primary or (str(err).strip().splitlines() or [type(err).__name__])[0]
    if diag.sqlstate:
        said += f" (SQLSTATE {diag.sqlstate})"
    if diag.message_detail:
        said += f"; detail: {diag.message_detail}"
    if diag.message_hint:
        said += f"; hint: {diag.message_hint}"
    return said


def _open_transactions(conn: psycopg.Connection) -> str:
    rows = conn.execute(
        "SELECT pid, coalesce(nullif(application_name, ''), usename::text, '?'), coalesce(state, '?'),"
        " round(extract(epoch FROM now() - xact_start))::int, left(coalesce(query, ''), 80)"
        " FROM pg_stat_activity WHERE xact_start IS NOT NULL AND pid <> pg_backend_pid()"
        " AND datname = current_database() ORDER BY xact_start LIMIT 5"
    ).fetchall()
    if not rows:
        return "none left"
    return "; ".join(f"pid {pid} ({app}, {state} for {age}s: {query!r})" for pid, app, state, age, query in rows)
