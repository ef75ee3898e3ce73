"""A command keeps its number of targets (migration 0007): the few-targets check reads it from the row.
Real Postgres: a database of its own, migrated up to 0006, then to the end with commands already in it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from animastor_tasks.adapters.postgres.migrations import migrate, migration_files
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.dev.probes import database_name, drop_database, ensure_database, with_database
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import make_book


@pytest.fixture
def before_0007(settings: Any) -> Iterator[str]:
    url = with_database(settings.database_url, f"{database_name(settings.database_url)}_0007")
    drop_database(url)
    ensure_database(url)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            for version, name, sql in migration_files():
                if version < 7:
                    conn.execute(sql.encode())
                    conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (version, name))
        yield url
    finally:
        drop_database(url)


def test_the_migration_counts_the_targets_of_the_commands_already_there(before_0007: str) -> None:
    sizes = {str(uuid.uuid4()): n for n in (1, 3, 250)}
    with psycopg.connect(before_0007) as conn:
        conn.execute("INSERT INTO books (book_id, title) VALUES ('old', 'old')")
        for command_id, n in sizes.items():
            conn.execute(
                "INSERT INTO commands (command_id, book_id, stage, status, request_id)"
                " VALUES (%s, 'old', 'audio', 'active', %s)",
                (command_id, str(uuid.uuid4())),
            )
            conn.execute(
                "INSERT INTO command_targets (command_id, book_id, chapter_id, scene_id, stage)"
                " SELECT %s, 'old', 'ch1', 's' || i, 'audio' FROM generate_series(1, %s) AS i",
                (command_id, n),
            )
    db = Database(before_0007)
    try:
        assert migrate(db) == [name for version, name, _ in migration_files() if version >= 7]
        with db.read() as conn:
            found = dict(conn.execute("SELECT command_id::text, target_count FROM commands").fetchall())
    finally:
        db.close()
    assert found == sizes


def test_a_regenerate_keeps_each_commands_number_of_targets(rt: Any) -> None:
    rt.catalog.import_book(make_book("counted", chapters=2, scenes=3))
    whole = regenerate_flow.regenerate(rt.ports, "counted", ["audio", "image"])
    one = regenerate_flow.regenerate(rt.ports, "counted", ["audio"], [["ch2", "s1"]])
    ids = [c["command_id"] for c in whole["commands"] + one["commands"]]
    with rt.db.read() as conn:
        found = dict(
            conn.execute(
                "SELECT command_id::text, target_count FROM commands WHERE command_id = ANY(%s::uuid[])", (ids,)
            ).fetchall()
        )
    assert sorted(found.values()) == [1, 6, 6]
