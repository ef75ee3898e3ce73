"""Upgrading a database (`db migrate`) on real Postgres: each migration commits on its own.

A database of its own, migrated up to 0005 as a release before 0006 left it."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from animastor_tasks.adapters.postgres import migrations
from animastor_tasks.adapters.postgres.migrations import MigrationFailed, migrate, migration_files
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.dev.probes import database_name, drop_database, ensure_database, with_database
from animastor_tasks.errors import StoreUnavailable

from .helpers import cli

# Refuses to run while any session holds `asset_states` exclusively (0006 adds a column under that lock).
_NOTHING_HOLDS_ASSET_STATES = """
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_locks WHERE relation = 'asset_states'::regclass AND mode = 'AccessExclusiveLock') THEN
        RAISE EXCEPTION 'asset_states is still locked exclusively';
    END IF;
END $$;
"""


def _database(settings: Any, suffix: str, below: int) -> Iterator[str]:
    url = with_database(settings.database_url, f"{database_name(settings.database_url)}_{suffix}")
    drop_database(url)
    ensure_database(url)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            for version, name, sql in migration_files():
                if version < below:
                    conn.execute(sql.encode())
                    conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (version, name))
        yield url
    finally:
        drop_database(url)


@pytest.fixture
def before_0006(settings: Any) -> Iterator[str]:
    yield from _database(settings, "mig0006", 6)


@pytest.fixture
def empty(settings: Any) -> Iterator[str]:
    yield from _database(settings, "migempty", 1)


def _applied(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [row[0] for row in conn.execute("SELECT version FROM schema_migrations ORDER BY version")]


def test_the_lock_0006_takes_is_released_before_the_next_migration_runs(
    before_0006: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [
        (version, name, _NOTHING_HOLDS_ASSET_STATES + sql if version == 7 else sql)
        for version, name, sql in migration_files()
    ]
    monkeypatch.setattr(migrations, "migration_files", lambda: files)
    db = Database(before_0006)
    try:
        assert migrate(db) == [name for version, name, _ in files if version >= 6]
    finally:
        db.close()
    assert _applied(before_0006) == [version for version, _, _ in files]


def test_a_failing_migration_keeps_those_before_it_and_the_next_run_goes_on(
    before_0006: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = migration_files()
    broken = [(v, n, "SELECT no_such_function();" if v == 8 else sql) for v, n, sql in real]
    db = Database(before_0006)
    try:
        monkeypatch.setattr(migrations, "migration_files", lambda: broken)
        with pytest.raises(
            MigrationFailed, match=r"0008_ended_commands\.sql failed at line 1: function no_such_function"
        ):
            migrate(db)
        assert _applied(before_0006) == [v for v, _, _ in real if v < 8]
        monkeypatch.setattr(migrations, "migration_files", lambda: real)
        assert migrate(db) == [n for v, n, _ in real if v >= 8]
    finally:
        db.close()
    assert _applied(before_0006) == [v for v, _, _ in real]


def test_two_migrates_at_once_apply_each_migration_once(empty: str) -> None:
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def run() -> None:
        db = Database(empty)
        try:
            results.append(migrate(db))
        except BaseException as err:  # reported below
            errors.append(err)
        finally:
            db.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sorted(results, key=len) == [[], [name for _, name, _ in migration_files()]]


@pytest.mark.parametrize("command", [("queues",), ("status", "b"), ("commands",), ("reconcile",)])
def test_a_database_not_migrated_is_named_so_with_what_to_run(
    empty: str, monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...]
) -> None:
    """Against a database not migrated, every read was a psycopg traceback (`relation "asset_states" does not
    exist`) and exit 1."""
    monkeypatch.setenv("ANIMASTOR_DATABASE_URL", empty)
    done = cli(*command)
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert "animastor-tasks db migrate" in done.stderr, done.stderr


def test_a_column_this_release_reads_and_the_database_lacks_is_a_store_not_ready(before_0006: str) -> None:
    """A release running before its `db migrate` (mid-upgrade): the missing column is Postgres not ready, a
    `StoreUnavailable` a job's verdict waits out, not a bug that failed the pair with a traceback."""
    db = Database(before_0006)
    try:
        with pytest.raises(StoreUnavailable, match="db migrate") as info, db.read() as conn:
            conn.execute("SELECT " + _column_added_by(6) + " FROM asset_states")
        assert info.value.store == "postgres"
    finally:
        db.close()


def _column_added_by(version: int) -> str:
    [sql] = [sql for v, _, sql in migration_files() if v == version]
    found = re.search(r"ADD COLUMN (?:IF NOT EXISTS )?(\w+)", sql, re.IGNORECASE)
    assert found, sql
    return found.group(1)


def test_a_missing_column_with_every_migration_applied_is_raised_as_the_bug_it_is(rt) -> None:
    """Only a database behind this release is "not migrated": on an up-to-date one a missing column is a bug in a
    statement, which would otherwise be retried as an outage for ever (a job's verdict for most of its time)."""
    with pytest.raises(psycopg.errors.UndefinedColumn), rt.db.read() as conn:
        conn.execute("SELECT no_such_column FROM asset_states")


@pytest.fixture
def before_0009(settings: Any) -> Iterator[str]:
    yield from _database(settings, "mig0009", 9)


def migrating(url: str) -> tuple[threading.Thread, list[BaseException | list[str]]]:
    """`migrate(lock_wait=3)` on `url` in a thread, not started yet, and where its answer or its error will be."""
    outcome: list[BaseException | list[str]] = []

    def run() -> None:
        db = Database(url)
        try:
            outcome.append(migrate(db, lock_wait=3.0))
        except BaseException as err:  # asserted by the caller
            outcome.append(err)
        finally:
            db.close()

    return threading.Thread(target=run), outcome


def _hold_commands_open(url: str) -> psycopg.Connection:
    """A session idle in a transaction that read `commands` (0009 alters that table)."""
    holder = psycopg.connect(url, application_name="report-left-open")
    holder.execute("SELECT count(*) FROM commands").fetchone()
    return holder


def test_a_migration_behind_a_transaction_left_open_gives_up_naming_it_and_traffic_is_not_held_behind_it(
    before_0009: str,
) -> None:
    """A migration waited for its table's lock as long as a transaction stayed open, and every statement on that
    table queued behind it: the old code was still waiting after 8 s (for ever, until the session ended)."""
    holder = _hold_commands_open(before_0009)
    thread, outcome = migrating(before_0009)
    try:
        thread.start()
        slowest = 0.0
        with psycopg.connect(before_0009, autocommit=True, options="-c statement_timeout=5000") as traffic:
            while thread.is_alive() and not outcome:
                started = time.monotonic()
                # Canceled: held behind the migration for the whole statement timeout.
                with contextlib.suppress(psycopg.errors.QueryCanceled):
                    traffic.execute("SELECT count(*) FROM commands").fetchone()
                slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.05)
                if time.monotonic() > started + 8:
                    break
        thread.join(8)
        assert not thread.is_alive(), "the migration still waits for the open transaction"
    finally:
        holder.close()
        thread.join(30)
    [err] = outcome
    assert isinstance(err, StoreUnavailable) and err.store == "postgres", err
    assert "0009_command_request_terms.sql" in str(err) and "report-left-open" in str(err), str(err)
    assert "idle in transaction" in str(err) and "db migrate" in str(err), str(err)
    assert slowest < 1.8, f"a read of the table waited {slowest:.2f}s behind the migration"
    assert 9 not in _applied(before_0009)
    # Once the transaction is gone the next run applies it.
    db = Database(before_0009)
    try:
        assert migrate(db, lock_wait=3.0) == [name for version, name, _ in migration_files() if version >= 9]
    finally:
        db.close()


def test_db_migrate_behind_an_open_transaction_exits_3_within_its_lock_wait(
    before_0009: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANIMASTOR_DATABASE_URL", before_0009)
    holder = _hold_commands_open(before_0009)
    try:
        started = time.monotonic()
        done = cli("db", "migrate", "--lock-wait", "1")
        took = time.monotonic() - started
    finally:
        holder.close()
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert "could not lock its tables within 1s" in done.stderr and "report-left-open" in done.stderr, done.stderr
    assert took < 20, took
    assert 9 not in _applied(before_0009)
