"""Upgrading a database (`db migrate`) on real Postgres: each migration commits on its own.

A database of its own, migrated up to 0005 as a release before 0006 left it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from animastor_tasks.adapters.postgres import migrations
from animastor_tasks.adapters.postgres.migrations import migrate, migration_files
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.dev.probes import database_name, drop_database, ensure_database, with_database

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
        with pytest.raises(psycopg.errors.UndefinedFunction):
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
