"""What `db migrate` says when it cannot do its work: a migration's own SQL failing, two files of one version.

A database of its own migrated up to 0009 (see test_migrations.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from animastor_tasks.adapters.postgres import migrations
from animastor_tasks.adapters.postgres.migrations import migrate, migration_files
from animastor_tasks.adapters.postgres.pool import NOT_MIGRATED, Database
from animastor_tasks.errors import AnimastorError, StoreUnavailable

from .test_migrations import _applied, _database


@pytest.fixture
def before_0009(settings: Any) -> Iterator[str]:
    yield from _database(settings, "migerr", 9)


@pytest.mark.parametrize(
    ("sql", "server_says"),
    [
        ("ALTER TABLE no_such ADD COLUMN c int;", 'relation "no_such" does not exist'),
        ("SELECT 1;\nALTER TABLE books DROP COLUMN no_such;", 'column "no_such" of relation "books" does not exist'),
        ("SELECT 1;\nSELECT no_such_function();", "at line 2: function no_such_function() does not exist"),
    ],
    ids=["undefined-table", "undefined-column", "other"],
)
def test_a_migration_whose_sql_fails_is_named_with_the_servers_message(
    before_0009: str, monkeypatch: pytest.MonkeyPatch, sql: str, server_says: str
) -> None:
    """A missing table or column in a migration's own SQL read as the database not being migrated: `db migrate`
    said to run `db migrate`, for ever; any other error was a traceback naming no file."""
    files = [*migration_files(), (9999, "9999_broken.sql", sql)]
    monkeypatch.setattr(migrations, "migration_files", lambda: files)
    db = Database(before_0009)
    try:
        with pytest.raises(AnimastorError) as info:
            migrate(db)
    finally:
        db.close()
    err = info.value
    assert not isinstance(err, StoreUnavailable), err  # the CLI's exit 3, "try again later"
    assert "9999_broken.sql" in str(err) and server_says in str(err), str(err)
    assert NOT_MIGRATED not in str(err), str(err)
    assert _applied(before_0009) == [v for v, _, _ in files if v != 9999]


def test_two_migrations_of_one_version_are_refused_naming_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second file's version was already recorded by the first: its insert hit a UniqueViolation, and on the
    next run it was skipped, never applied, for ever."""
    for name in ("0001_init.sql", "0002_a.sql", "0002_b.sql"):
        (tmp_path / name).write_text("SELECT 1;", encoding="utf-8")
    monkeypatch.setattr(migrations, "_folder", lambda: tmp_path)
    with pytest.raises(AnimastorError, match=r"0002_a\.sql.*0002_b\.sql"):
        migration_files()


def test_the_migrations_shipped_have_a_version_each() -> None:
    versions = [version for version, _, _ in migration_files()]
    assert versions == sorted(set(versions))
