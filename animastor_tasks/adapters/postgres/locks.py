"""The book's advisory lock, which every whole-book write and every claim and commit of the book take first."""

from __future__ import annotations

from typing import Any

import psycopg

from animastor_tasks.adapters.postgres.pool import BOOK_BUSY_WAIT_MS, bound_lock_wait
from animastor_tasks.domain.keys import book_lock
from animastor_tasks.errors import BookBusy


def lock_book(conn: psycopg.Connection[Any], book: str, *, soon: bool = False) -> None:
    """The book's advisory lock, taken before any row: a release settles commands under the lock a completion
    settles them under (`jobs._lock_capacity`), so the two never miss each other's last target. `soon`: waited for
    `BOOK_BUSY_WAIT_MS` at most, then `BookBusy` (the lock waits bounded as usual after it): for a gate pass's
    writes, which give a busy book up rather than hold a control process through an import or a Stop All."""
    bound_lock_wait(conn)
    if not soon:
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (book_lock(book),))
        return
    conn.execute(f"SET LOCAL lock_timeout = {BOOK_BUSY_WAIT_MS}")
    try:
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (book_lock(book),)).fetchone()
    except psycopg.errors.LockNotAvailable as err:
        raise BookBusy(book, BOOK_BUSY_WAIT_MS / 1000) from err
    bound_lock_wait(conn)
