"""A lane's advisory lock is held only for the few milliseconds of a claim or a commit: never while its holder waits
for a book's lock, so one book's long transaction (a whole-book regenerate, a re-import) holds up that book alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest

from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, fake_artifact, make_book
from .test_generate import dispatched_jobs

LANE = "gpu.audio"
_WAITING = (  # advisory locks asked for and not granted, in this run's database (other runs share the server)
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


@pytest.fixture
def books(rt):  # type: ignore[no-untyped-def]
    """Two books with audio jobs running on the same lane."""
    advertise(rt, LANE)
    for book in ("bx", "by"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=3))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
        assert dispatched_jobs(rt, book), book
    return "bx", "by"


def commit(rt: Wiring, book: str) -> Callable[[], object]:
    """The commit of one of the book's running jobs, as the GPU worker sends it."""
    job = dispatched_jobs(rt, book)[0]
    return lambda: rt.ports.jobs.commit_job(*job.owned, fake_artifact(book), LANE)


def claim(rt: Wiring, book: str) -> Callable[[], object]:
    """A claim transaction of the book on the lane, as a gate pass opens it."""

    def run() -> object:
        with rt.ports.assets.claiming(book, {"audio": LANE}) as session:
            return session.counts.lane

    return run


class Timed(threading.Thread):
    """`fn` run in a thread of its own: what it answered or raised, and how long it took."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: object = None
        self.error: Exception | None = None
        self.took: float | None = None

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.result = self.fn()
        except Exception as err:  # reported by the test
            self.error = err
        self.took = time.monotonic() - started

    @classmethod
    def begin(cls, fn: Callable[[], object]) -> Timed:
        thread = cls(fn)
        thread.start()
        return thread


def wait_for_lock_waiters(url: str, count: int, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    with psycopg.connect(url, autocommit=True) as conn:
        while (conn.execute(_WAITING).fetchone() or (0,))[0] < count:
            assert time.monotonic() < deadline, f"fewer than {count} session(s) waiting for an advisory lock"
            time.sleep(0.02)


@contextmanager
def book_lock_held(url: str, book: str) -> Iterator[None]:
    """The book's lock held by another session (a whole-book regenerate, an import) until the block ends."""
    with psycopg.connect(url) as conn:
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"book:{book}",))
        try:
            yield
        finally:
            conn.rollback()


def test_a_commit_waiting_for_its_book_holds_no_lane(rt, books) -> None:
    """Book X's commit, waiting behind X's long book-lock holder, held the lane's lock meanwhile (lane, then book):
    every commit and claim of every other book on the lane waited for X's holder (1.2-2.1 s for a whole-book
    regenerate of 50,000 scenes)."""
    x, y = books
    url = rt.settings.database_url
    with book_lock_held(url, x):
        stuck = Timed.begin(commit(rt, x))
        wait_for_lock_waiters(url, 1)  # X's commit waits for X's lock
        others = [Timed.begin(commit(rt, y)), Timed.begin(claim(rt, y))]
        for other in others:
            other.join(1.0)
        assert [t.is_alive() for t in others] == [False, False], "book Y's commit and claim waited on the lane"
        assert [t.error for t in others] == [None, None]
        assert stuck.is_alive(), "X's commit waits for X's holder"
    stuck.join(10)
    assert stuck.error is None and stuck.result is not None  # committed once the holder let go
