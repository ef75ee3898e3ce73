"""A database that answers but takes no writes (a standby the URL still names after a failover, a database set
read-only): its refusal says so, and the sessions opened meanwhile are not kept once it takes writes again (the
run's own database, set read-only for new sessions and back)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.errors import StoreUnavailable


@pytest.fixture
def read_only(rt) -> Iterator[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """(the database's URL, its name), read-only for new sessions until the test ends."""
    url = rt.settings.database_url
    with psycopg.connect(url, autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
        conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    try:
        yield url, name
    finally:
        _writable_again(url, name)


def _writable_again(url: str, name: str) -> None:
    with psycopg.connect(url, autocommit=True, options="-c default_transaction_read_only=off") as conn:
        conn.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')


def _write(db: Database) -> None:
    with db.transaction() as conn:
        conn.execute("CREATE TEMP TABLE IF NOT EXISTS probe (n int)")
        conn.execute("INSERT INTO probe VALUES (1)")
        conn.execute("DELETE FROM books WHERE book_id = 'never-a-book'")


def test_a_database_that_takes_no_writes_says_so_and_its_sessions_go_once_it_takes_them_again(read_only) -> None:
    """Old code: 'cannot execute DELETE in a read-only transaction' alone; and every write after the database took
    writes again failed on the sessions opened before, until they were killed (a finished job's result given up
    after its retries, its GPU work done again: found by a read-only Postgres hunt)."""
    url, name = read_only
    db = Database(url, max_size=2)
    try:
        with pytest.raises(StoreUnavailable, match="answers but takes no writes") as refused:
            _write(db)
        assert "read-only transaction" in str(refused.value)
        _writable_again(url, name)
        # As a job's verdict is written again (`when_reachable`): a session the pool opened before the database took
        # writes again may refuse one more, then it is dropped in turn. Old code: every try refused, for good.
        refusals = 0
        for _ in range(3):
            try:
                _write(db)
                break
            except StoreUnavailable:
                refusals += 1
        assert refusals < 3
    finally:
        db.close()
