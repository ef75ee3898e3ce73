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


def test_each_refusal_replaces_only_its_own_session(read_only, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review of the first fix: the whole pool drained at each refusal, and every idle session reopened, 336 sessions
    opened for 42 refusals over 5 s, for as long as the database took no writes."""
    from contextlib import ExitStack

    from animastor_tasks.adapters.postgres import pool

    url, _ = read_only
    db = Database(url, max_size=4)
    try:
        with ExitStack() as held:  # four idle sessions in the pool
            for _ in range(4):
                held.enter_context(db.read())
        opened: list[object] = []
        connect = pool._Connection.connect.__func__  # type: ignore[attr-defined]

        def counted(cls: type, *args: object, **kwargs: object) -> object:
            opened.append(1)
            return connect(cls, *args, **kwargs)

        monkeypatch.setattr(pool._Connection, "connect", classmethod(counted))
        for _ in range(5):
            with pytest.raises(StoreUnavailable):
                _write(db)
        assert len(opened) <= 5, len(opened)
    finally:
        db.close()
