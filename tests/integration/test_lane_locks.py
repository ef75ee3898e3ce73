"""A lane's advisory lock is held only for the few milliseconds of a claim or a commit: never while its holder waits
for a book's lock, so one book's long transaction (a whole-book regenerate, a re-import) holds up that book alone;
and the wait for it is bounded, so a holder gone silent holds up nobody for good."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest

from animastor_tasks.adapters.postgres import pool
from animastor_tasks.errors import StoreUnavailable
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
    """Three books with audio jobs running on the same lane."""
    advertise(rt, LANE)
    for book in ("bx", "by", "bz"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=3))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
        assert dispatched_jobs(rt, book), book
    return "bx", "by", "bz"


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
    x, y, _ = books
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


# A session that takes a lock as a commit does (in a pipeline, which keeps the server's
# idle_in_transaction_session_timeout from ever firing) and then stops answering before its COMMIT: SIGSTOP stands
# in for a host lost or cut off, or a frozen container, which the server cannot tell from a slow client. The lock:
# the advisory lock named by its third argument, or with a fourth the row that statement locks.
_STALLED_HOLDER = """
import os, signal, sys, psycopg
with psycopg.connect(sys.argv[1]) as conn:
    with conn.pipeline():
        conn.execute(sys.argv[3] if len(sys.argv) > 3 else "SELECT pg_advisory_xact_lock(hashtext(%s))", (sys.argv[2],))
    print("locked", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


# A commit's locks taken by the runtime's own code (its bounds with them), its transaction limited to 2 s.
_STALLED_COMMIT = """
import os, signal, sys
from animastor_tasks.adapters.postgres import jobs, pool
pool.TRANSACTION_LIMIT_MS = 2000
db = pool.Database(sys.argv[1])
with db.transaction() as conn:
    with conn.pipeline():
        jobs._lock_capacity(conn, sys.argv[2], sys.argv[3])
    print("locked", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@contextmanager
def stalled_holder(script: str, *args: str) -> Iterator[None]:
    """`script` run with `args` until it says it holds its lock and stops itself; killed when the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()


def test_a_holder_gone_silent_holds_up_the_lane_s_other_books_for_a_bounded_time(rt, books) -> None:
    """A client silent mid-transaction while it holds a lane's lock: every claim and commit of the lane, from every
    host, waited for it with no bound (until TCP keepalive gave up on a lost host, about 2 h 11 min by default; a
    frozen container, never). Both control processes stuck in a claim stop the tick and Stop All for every book.
    The wait is bounded (`pool.LOCK_WAIT_MS`): they end as the store unavailable, which their callers retry."""
    _, y, z = books
    url = rt.settings.database_url
    bound = pool.LOCK_WAIT_MS / 1000 + 5.0  # each lock's wait: two books here, neither waiting for the other's
    running = dispatched_jobs(rt, y)
    with stalled_holder(_STALLED_HOLDER, url, f"lane:{LANE}"):
        deadline = time.monotonic() + bound
        waiters = [Timed.begin(commit(rt, y)), Timed.begin(claim(rt, z))]
        for waiter in waiters:
            waiter.join(max(0.0, deadline - time.monotonic()))
        assert [w.is_alive() for w in waiters] == [False, False], f"still waiting for the lane after {bound} s"
    assert [type(w.error) for w in waiters] == [StoreUnavailable, StoreUnavailable]
    assert "lock" in str(waiters[1].error), waiters[1].error  # old code: the statement timeout's words alone
    assert dispatched_jobs(rt, y) == running  # nothing of the commit stayed: the job still runs, its commit tried again
    # The holder gone, the lane is free again: the commit that was refused goes in.
    assert waiters[0].fn() is not None


def test_a_silent_holder_s_transaction_ends_on_postgresql_17(rt, books) -> None:
    """PostgreSQL 17 and later end the silent holder's transaction itself (`pool.TRANSACTION_LIMIT_MS`), and with it
    its locks: the lane is free again for every book, not only refused to them for a while."""
    x, y, _ = books
    url = rt.settings.database_url
    with rt.db.read() as conn:
        if conn.info.server_version < 170000:
            pytest.skip("transaction_timeout is PostgreSQL 17's")
    with stalled_holder(_STALLED_COMMIT, url, LANE, x):
        waiter = Timed.begin(claim(rt, y))
        waiter.join(pool.LOCK_WAIT_MS / 1000 - 2)  # ended by the holder's limit (2 s), not its own wait's
        assert not waiter.is_alive() and waiter.error is None, waiter.error


def test_a_book_s_lock_held_by_a_silent_holder_refuses_its_book_s_commands_in_bounded_time(rt, books, monkeypatch):
    """A client silent while it holds a book's lock (an import or a Stop All from a host cut off): a regenerate and a
    Stop All of that book waited for it with no bound, each holding a control process for good (no control task has
    a time limit). They end as the store unavailable within `pool.LOCK_WAIT_MS`, having changed nothing."""
    monkeypatch.setattr(pool, "LOCK_WAIT_MS", 1000)
    x, _, _ = books
    url = rt.settings.database_url
    before = commands_of(rt, x)
    with stalled_holder(_STALLED_HOLDER, url, f"book:{x}"):
        waiters = [
            Timed.begin(lambda: regenerate_flow.regenerate(rt.ports, x, ["audio"])),
            Timed.begin(lambda: rt.ports.commands.cancel_book(x, "stop")),
            Timed.begin(lambda: rt.catalog.import_book(make_book(x, chapters=1, scenes=4))),
        ]
        for waiter in waiters:
            waiter.join(6.0)
        assert [w.is_alive() for w in waiters] == [False, False, False], "still waiting for the book's lock"
    assert [type(w.error) for w in waiters] == [StoreUnavailable] * 3, [w.error for w in waiters]
    assert [w.took is not None and w.took < 5.0 for w in waiters] == [True] * 3
    assert commands_of(rt, x) == before


def commands_of(rt: Wiring, book: str) -> list[tuple[str, str]]:
    with rt.db.read() as conn:
        rows = conn.execute("SELECT command_id::text, status FROM commands WHERE book_id = %s ORDER BY 1", (book,))
        return [(str(c), str(s)) for c, s in rows.fetchall()]


def test_a_layers_change_behind_a_silent_holder_of_the_book_s_row_ends_in_bounded_time(rt, books, monkeypatch):
    """`layers set` waits for the book's row, which an import writes: behind a silent one it waited for good."""
    monkeypatch.setattr(pool, "LOCK_WAIT_MS", 1000)
    x, _, _ = books
    before = rt.catalog.layers(x)
    row_lock = "SELECT 1 FROM books WHERE book_id = %s FOR UPDATE"
    with stalled_holder(_STALLED_HOLDER, rt.settings.database_url, x, row_lock):
        waiter = Timed.begin(lambda: rt.catalog.change_layers(x, {"audio": False}))
        waiter.join(6.0)
        assert not waiter.is_alive(), "still waiting for the book's row"
    assert type(waiter.error) is StoreUnavailable, waiter.error
    assert rt.catalog.layers(x) == before


def test_a_slot_handed_to_a_book_whose_lock_is_held_goes_to_the_next_waiting_book(rt) -> None:
    """Book Y's lock held for seconds by another transaction (an import or a regenerate of a big book) as a job ends
    and its slot is handed to Y, the head of the waiting list. Old code: the GPU process's refill waited the whole
    lock wait (10 s) and gave up, and the slot idled that long while book Z waited (found by a hunt: every lane of
    the farm stalled 9-12.6 s at each re-import of a 100,000-scene book)."""
    from animastor_tasks.flow import refill

    from .test_elastic_share import lane, run_control, waiting

    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book in ("x", "y", "z"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
        time.sleep(0.01)  # y waits longer than z
    [job] = dispatched_jobs(rt, "x")
    assert set(waiting(rt)) >= {"y", "z"}
    left = rt.ports.jobs.commit_job(*job.owned, fake_artifact("x"), LANE)
    assert left is not None

    with book_lock_held(rt.settings.database_url, "y"):
        began = time.monotonic()
        refill.free_slot(rt.ports, "x", LANE, job.dispatch_id, left=left, here=True)
        took = time.monotonic() - began
        sent = run_control(rt)  # the refill the slot was handed on with, as the control worker runs it
        running = {j.book_id for j in (*dispatched_jobs(rt, "y"), *dispatched_jobs(rt, "z"))}

    assert took < 6, f"the refill waited {took:.1f}s for the busy book"
    assert running == {"z"}, sent  # the slot went to the next waiting book
    assert "y" in waiting(rt)  # the busy book waits on for the lane


def test_a_gate_pass_of_a_busy_book_gives_it_up_in_its_short_wait(rt) -> None:
    """A pass's writes (its release of denied pairs, its settle of already completed ones) waited the whole lock wait
    for a book an import held, and a paged pass of a big one held a control process 30 s, the lane's handed-on
    refills queued behind it (found by a hunt re-testing d428ef2)."""
    from animastor_tasks.flow import cancel as cancel_flow
    from animastor_tasks.flow import gate

    from .test_elastic_share import lane

    lane(rt, lane_limit=1, book_quota=1, window=1)  # one pair dispatched, two pending
    rt.catalog.import_book(make_book("y", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "y", ["audio"])
    rt.redis.client.set(rt.redis.keys.cancel_flag("y"), "stop")  # its pending pairs denied: the pass releases them
    with book_lock_held(rt.settings.database_url, "y"):
        began = time.monotonic()
        with pytest.raises(StoreUnavailable, match="book 'y' busy"):  # its caller passes the other books on
            gate.gate_pass(rt.ports, "y")
        took = time.monotonic() - began
    cancel_flow.cancel(rt.ports, "y")
    assert took < 6, f"the pass waited {took:.1f}s for the busy book"


def test_a_regenerate_whose_first_pass_finds_its_book_busy_is_written_and_left_to_the_tick(rt, monkeypatch) -> None:
    """Another transaction takes the book's lock between the command's write and its first pass's claim (an import,
    a Stop All). Old code: the regenerate raised the claim's short wait as an outage after writing its command (the
    review: 'postgres unavailable at :'), and its caller resent a command that stood already."""
    from animastor_tasks.flow import gate

    from .test_elastic_share import lane

    lane(rt, lane_limit=1, book_quota=1, window=1)
    rt.catalog.import_book(make_book("y", chapters=1, scenes=3))
    start_work = regenerate_flow._start_work
    held: list[object] = []

    def then_busy(*args: object, **kwargs: object) -> object:
        started = start_work(*args, **kwargs)  # type: ignore[arg-type]
        held.append(book_lock_held(rt.settings.database_url, "y"))
        held[0].__enter__()  # type: ignore[attr-defined]
        return started

    monkeypatch.setattr(regenerate_flow, "_start_work", then_busy)
    try:
        answer = regenerate_flow.regenerate(rt.ports, "y", ["audio"])
    finally:
        if held:
            held[0].__exit__(None, None, None)  # type: ignore[attr-defined]
    assert [c["status"] for c in answer["commands"]] == ["active"]
    assert dispatched_jobs(rt, "y") == []
    assert rt.redis.client.zscore(rt.redis.keys.due(), "y") is not None  # the tick's next pass is its
    gate.gate_batch(rt.ports, ["y"])
    assert len(dispatched_jobs(rt, "y")) == 1
