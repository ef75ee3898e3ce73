"""`db migrate` beside live traffic and other sessions: which locks a migration holds while it waits, and for how long.

Databases of their own, migrated up to a release before the migration under test (see test_migrations.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from animastor_tasks.adapters.postgres import migrations
from animastor_tasks.errors import StoreUnavailable

from .test_migrations import _applied, _database, migrating

PAIRS = 400_000  # enough that 0006's backfill takes clearly longer than a lock try (1 s)


@pytest.fixture
def before_0006(settings: Any) -> Iterator[str]:
    yield from _database(settings, "mig0006locks", 6)


@pytest.fixture
def big_before_0006(settings: Any) -> Iterator[str]:
    for url in _database(settings, "mig0006big", 6):
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("INSERT INTO books (book_id, title) VALUES ('b', 'B')")
            conn.execute("INSERT INTO chapters (book_id, chapter_id, position) VALUES ('b', 'c', 0)")
            conn.execute(
                "INSERT INTO scenes (book_id, chapter_id, scene_id, position, text)"
                " SELECT 'b', 'c', 's' || n, n, 't' FROM generate_series(1, %s) n",
                (PAIRS // 4,),
            )
            conn.execute(
                "INSERT INTO asset_states (book_id, chapter_id, scene_id, stage)"
                " SELECT 'b', 'c', 's' || n, st FROM generate_series(1, %s) n,"
                " unnest(ARRAY['audio', 'image', 'video', 'music']) st",
                (PAIRS // 4,),
            )
            conn.execute("ANALYZE")
        yield url


def _backfill_seconds(url: str) -> float:
    """How long 0006's backfill takes here, rolled back."""
    with psycopg.connect(url) as conn:
        conn.execute("ALTER TABLE asset_states ADD COLUMN position integer")
        started = time.monotonic()
        conn.execute(
            "UPDATE asset_states a SET position = s.position FROM scenes s"
            " WHERE s.book_id = a.book_id AND s.chapter_id = a.chapter_id AND s.scene_id = a.scene_id"
        )
        took = time.monotonic() - started
        conn.rollback()
    return took


def test_0006_waiting_for_scenes_does_not_hold_asset_states_through_its_backfill(big_before_0006: str) -> None:
    """0006 locked `asset_states` exclusively, rewrote every row, and only then asked for `scenes` (its trigger):
    behind a session holding a write lock on scenes, every try held the pairs' table for the whole backfill and
    then gave up, and every read or write of a pair waited backfill + 1 s, over and over for the whole --lock-wait."""
    url = big_before_0006
    backfill = _backfill_seconds(url)
    assert backfill > 1.5, f"the backfill took {backfill:.2f}s: too few rows to tell"
    holder = psycopg.connect(url, application_name="scene-writer-left-open")
    holder.execute("UPDATE scenes SET prompt = prompt WHERE false")
    thread, outcome = migrating(url)
    slowest = 0.0
    try:
        thread.start()
        with psycopg.connect(url, autocommit=True, options="-c statement_timeout=15000") as traffic:
            while thread.is_alive():
                started = time.monotonic()
                with contextlib.suppress(psycopg.errors.QueryCanceled):
                    traffic.execute("SELECT count(*) FROM asset_states").fetchone()
                slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.05)
        thread.join(30)
    finally:
        holder.close()
        thread.join(30)
    [err] = outcome
    assert isinstance(err, StoreUnavailable) and "0006_pending_reading_order.sql" in str(err), err
    assert "scene-writer-left-open" in str(err), str(err)
    assert slowest < 1.5, f"a read of asset_states waited {slowest:.2f}s (the backfill takes {backfill:.2f}s)"
    assert 6 not in _applied(url)


def test_db_migrate_behind_another_holding_the_migration_lock_exits_3_within_its_lock_wait(
    before_0006: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The migration lock (a session advisory lock) was waited for without bound and without a word, before any
    lock timeout was set: behind a migrate stuck on something else, or a session that kept the lock, `db migrate`
    hung silently."""
    holder = psycopg.connect(before_0006, autocommit=True, application_name="stuck-migrate")
    holder.execute("SELECT pg_advisory_lock(%s)", (migrations._MIGRATIONS_LOCK_ID,))
    monkeypatch.setenv("ANIMASTOR_DATABASE_URL", before_0006)
    try:
        started = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "animastor_tasks.operator.cli", "db", "migrate", "--lock-wait", "1"],
                capture_output=True,
                text=True,
                timeout=15,
                env=os.environ.copy(),
            )
        except subprocess.TimeoutExpired:
            pytest.fail("db migrate still waits for the migration lock after 15 s")
        took = time.monotonic() - started
    finally:
        holder.close()
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert "stuck-migrate" in done.stderr and "1s" in done.stderr, done.stderr
    assert "waiting for the migration lock, held by" in done.stderr, done.stderr
    assert took < 12, took
    assert 6 not in _applied(before_0006)
