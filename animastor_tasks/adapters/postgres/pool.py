"""The Postgres connection pool of one process.

A pool belongs to one process: after a fork (Celery prefork children) the child
builds its own on first use, so no connection ever crosses a fork. Driver errors
become `StoreUnavailable` here, at the edge.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Self, TypeVar
from urllib.parse import unquote

import psycopg
from psycopg import pq
from psycopg.abc import PQGen
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool, PoolTimeout

from animastor_tasks.errors import ConfigError, StoreUnavailable, redact_url

log = logging.getLogger("animastor.postgres")
#: New rows of one book from which a write analyzes the tables it wrote (`Database.analyze`): below, a nested loop
#: over the book's rows costs little (80 ms at 500 pairs, quadratic above).
ANALYZE_FROM_ROWS = 500
ANALYZE_LOCK_WAIT_MS = 500
#: The longest a transaction that takes a lane's lock waits for any one lock (`bound_lock_waits`). A lane's lock is
#: held 1-3 ms per claim or commit, and the longest a book's lock is held is a whole-book regenerate or import: about
#: 2 s at 50,000 scenes, 3-4 s at 100,000.
LOCK_WAIT_MS = 10_000
#: How long a claim or a gate pass's write waits for its book's lock before the book counts as busy (`BookBusy`): a
#: claim or a commit holds it milliseconds, a whole-book import, regenerate or Stop All seconds.
BOOK_BUSY_WAIT_MS = 1_000
#: Who may hold the lock a wait gave up on, as a lock wait's error says (read as an outage, an operator looked for one).
BOOK_HOLDERS = (
    "another transaction: an import, a regenerate or a Stop All of the same book, or a client gone silent"
    " mid-transaction; try again"
)
LANE_HOLDERS = (
    "another transaction: a claim or a job's end on the lane, or a client gone silent mid-transaction; try again"
)
#: PostgreSQL 17 and later: the longest such a transaction lasts at all, its lock waits and a claim's Redis round trip
#: (5 s at most) included. Past it the server ends the session, and with it the locks a silent client held.
TRANSACTION_LIMIT_MS = 60_000


RV = TypeVar("RV")

_STORE_ERRORS = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    PoolTimeout,
    psycopg.errors.ReadOnlySqlTransaction,
    # psycopg.errors.LockNotAvailable (a lock_timeout, `bound_lock_waits`) is an OperationalError: a store error too.
    # The server's own timeouts end the session, as a restart does (they are InternalErrors, not OperationalErrors).
    psycopg.errors.IdleInTransactionSessionTimeout,
    psycopg.errors.TransactionTimeout,
)


# The server ended this session alone, for how it used it: the pool's other connections are left as they are.
_SESSION_OWN_ENDS = (psycopg.errors.IdleInTransactionSessionTimeout, psycopg.errors.TransactionTimeout)


def _is_store_error(err: BaseException) -> bool:
    """The store, not the statement: it cannot be reached, or it takes no writes (a standby, a primary being
    demoted in a failover, which the URL may still reach: a write there was a traceback)."""
    return isinstance(err, _STORE_ERRORS)


def _not_an_aborted_pipeline(record: logging.LogRecord) -> bool:
    """psycopg's warning that a pipeline could not end after an error raised inside it is left out: that error goes
    on to its caller (a duplicate request, replayed; a lock wait cut short), and the warning ("error ignored
    terminating <psycopg.Pipeline [INERROR]>: pipeline aborted") was read by operators as a second error."""
    args = record.args
    return not (
        str(record.msg).startswith("error ignored")
        and isinstance(args, tuple)
        and any(isinstance(arg, psycopg.errors.PipelineAborted) for arg in args)
    )


logging.getLogger("psycopg").addFilter(_not_an_aborted_pipeline)


# A table or column this release reads is missing: the database is not migrated (yet: mid-upgrade, a new release
# running before `db migrate`). A store not ready, not a bug: the CLI exits 3 saying what to run, and a job's
# verdict waits for it as for a restart (`when_reachable`). It was a psycopg traceback, exit 1.
_SCHEMA_BEHIND = (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn)


READ_ONLY = (
    "the server answers but takes no writes: a standby, a primary being demoted, or default_transaction_read_only;"
    " the URL must name the primary"
)
NOT_MIGRATED = "the database is not migrated to this release; run `animastor-tasks db migrate`"

#: Why the last attempt to connect to each URL failed, until one succeeds.
_refusals: dict[str, str] = {}


#: The longest one wait for the server's answer lasts (a statement's, a pipeline's, a commit's), but a migration's.
#: Past it the connection is ended and the call fails as the store unavailable. *Why:* a connection whose data the
#: server's side acknowledged and never answered (a hung proxy or pooler, a stopped server process) waited for good:
#: the keepalives and `tcp_user_timeout` (`DEAD_PEER`) see nothing wrong, and two GPU processes, in a commit's and a
#: refill's round trip, held their slots idle until the proxy was killed (8 minutes in a hunt).
ANSWER_LIMIT_S = TRANSACTION_LIMIT_MS / 1000


class _Connection(psycopg.Connection[TupleRow]):
    """A pool's connection that remembers why connecting failed, and waits for an answer `answer_limit` seconds at
    most (`ANSWER_LIMIT_S`; None: without a bound). *Why the first:* a pool that cannot connect answers only
    "couldn't get a connection after 5.00 sec": a misspelt database or role, or a wrong password, read as Postgres
    being down, the reason left in the pool's log lines."""

    answer_limit: float | None = ANSWER_LIMIT_S

    def wait(self, gen: PQGen[RV], interval: float = 0.1, timeout: float | None = None) -> RV:
        limit = self.answer_limit if timeout is None else timeout
        try:
            return super().wait(gen, interval, limit)
        except psycopg.errors._WaitTimeout:  # psycopg's own, raised for the caller to turn into its error
            self.pgconn.finish()  # a late answer cannot be told from the next one's: the connection is ended (broken)
            raise psycopg.OperationalError(f"no answer from the server within {limit:g}s; connection ended") from None

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        try:
            conn = super().connect(conninfo, **kwargs)
        except psycopg.OperationalError as err:
            _refusals[conninfo] = " ".join(str(err).split())
            raise
        _refusals.pop(conninfo, None)
        return conn


@contextmanager
def answering_within(conn: psycopg.Connection[Any], seconds: float | None) -> Iterator[None]:
    """Each answer on `conn` waited for `seconds` at most in the block (None: without a bound), then `ANSWER_LIMIT_S`
    again. None: a migration's session or the journal's prune, one statement of which may rewrite a big table for
    longer than `ANSWER_LIMIT_S`. Shorter: a short transaction whose caller should not wait a minute on a server that
    took the connection and answers nothing (a job's start check)."""
    if not isinstance(conn, _Connection):
        yield
        return
    conn.answer_limit = seconds
    try:
        yield
    finally:
        conn.answer_limit = ANSWER_LIMIT_S


#: How soon a connection whose server stopped answering is given up (libpq's names; the URL's own win): keepalive
#: probes after 10 s without traffic, and 30 s at most of data the server has not acknowledged. *Why:* across a
#: partition that drops packets (a GPU host cut off from the database) a query waited on TCP's own retries: on a
#: link that healed, up to two minutes more for the next one; on one that did not, about 15 minutes.
DEAD_PEER = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
             "tcp_user_timeout": 30_000}  # fmt: skip


def _dead_peer_defaults(url: str) -> dict[str, Any]:
    named = conninfo_to_dict(url)
    return {name: value for name, value in DEAD_PEER.items() if name not in named}


#: The databases whose pool this process opened and has not closed yet (`close_open_pools`).
_open: weakref.WeakSet[Database] = weakref.WeakSet()


@atexit.register
def close_open_pools() -> None:
    """Every pool this process still holds, closed on its way out. *Why:* on Python 3.13 a pool left open until the
    interpreter's last moments cannot stop its threads there and waits 5 s for each: every CLI command took 20 s
    more to exit, and a solo-pool worker 21 s to stop."""
    for db in list(_open):
        db.close()


# A socket directory nothing listens in: libpq judges a URL's options, then fails to connect, off the network.
_NOWHERE = "/nonexistent/animastor-url-check"
# Not judged there: where to connect and as whom (the check's own), and what reads files (a service, a passfile).
_WHERE_AND_WHO = {"host", "hostaddr", "port", "dbname", "user", "password", "passfile", "service", "servicefile"}
_PASSWORDS = re.compile(r"://[^:/@\s]*:([^@/\s]*)@|password\s*=\s*('(?:[^'\\]|\\.)*'|[^&\s]*)", re.I)


def _check_url(url: str) -> None:
    """ANIMASTOR_DATABASE_URL's option names and values as libpq takes them. *Why:* a misspelt option
    (`?connect_timout=5`) or a value libpq refuses (`?sslmode=bogus`) failed every connection, reported as
    Postgres unavailable (exit 3) after the pool's whole timeout: a setting to fix (exit 2)."""
    try:
        options = conninfo_to_dict(url)
    except psycopg.ProgrammingError as err:
        raise ConfigError(_refused(url, str(err))) from None
    judged = {k: v for k, v in options.items() if k not in _WHERE_AND_WHO and v is not None}
    if judged.get("gssencmode") == "require":
        del judged["gssencmode"]  # refused over a local socket, the check's own
    if (port := options.get("port")) and "," not in str(port):
        judged["port"] = port  # one port only: libpq matches a list of them to the hosts
    conn = pq.PGconn.connect_start(make_conninfo("", host=_NOWHERE, password="-", **judged).encode())
    try:
        said = conn.error_message.decode(errors="replace").strip()
    finally:
        conn.finish()
    if _NOWHERE not in said:  # refused before it tried to connect
        raise ConfigError(_refused(url, said.splitlines()[0] if said else "libpq refuses its options"))


def _refused(url: str, said: str) -> str:
    """The driver's words, left out where they repeat the password (psycopg quotes a bad percent-encoding)."""
    said = said.strip()
    for match in _PASSWORDS.finditer(url):
        secret = (match.group(1) or match.group(2) or "").strip("'")
        if secret and (secret in said or unquote(secret) in said):
            said = (
                "refused; the driver's message is left out, as it repeats the password (a `%` in one is written `%25`)"
            )
    return f"ANIMASTOR_DATABASE_URL={redact_url(url)!r}: {said}"


def bound_lock_waits(conn: psycopg.Connection[Any]) -> None:
    """The transaction's lock waits bounded (`LOCK_WAIT_MS`), and on PostgreSQL 17 and later its length
    (`TRANSACTION_LIMIT_MS`): sent first in the transaction's pipeline, no round trip of their own. *Why:* a client
    gone silent in the middle of a claim or a commit (a host lost or cut off, a frozen container) held its lane's
    lock with no time bound, and every claim and commit of the lane, from every host, waited for it; both control
    processes stuck in a claim, the tick and Stop All stopped for every book. The server's
    idle_in_transaction_session_timeout never fires after a psycopg pipeline (its Flush after the Sync disarms it).
    A wait cut short is `StoreUnavailable`: a claim is rolled back, a job's verdict written again (`when_reachable`).
    Asked of PostgreSQL 15 or 16, `transaction_timeout` fails the transaction, so it is sent only to a newer server
    (the version libpq read at connect)."""
    bound_lock_wait(conn)
    if conn.info.server_version >= 170000:
        conn.execute(f"SET LOCAL transaction_timeout = {TRANSACTION_LIMIT_MS}")


def bound_lock_wait(conn: psycopg.Connection[Any]) -> None:
    """The transaction's lock waits bounded (`LOCK_WAIT_MS`), its length not: a whole-book transaction (an import,
    a regenerate) waits for its book's lock no longer than a lane's claim does, and ends as the store unavailable
    (refused whole, retried by its caller) instead of holding a control process for good behind a silent holder."""
    conn.execute(f"SET LOCAL lock_timeout = {LOCK_WAIT_MS}")


class Database:
    def __init__(self, url: str, *, max_size: int = 8, timeout: float = 5.0) -> None:
        _check_url(url)
        self.url = url
        self._max_size = max_size
        self._timeout = timeout
        self._pool: ConnectionPool | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def _get_pool(self) -> ConnectionPool:
        pid = os.getpid()
        if self._pool is None or self._pid != pid:
            with self._lock:
                if self._pool is None or self._pid != pid:
                    # A pool inherited across fork is abandoned, never used or closed here.
                    self._pool = ConnectionPool(
                        self.url,
                        min_size=0,
                        max_size=self._max_size,
                        timeout=self._timeout,
                        open=True,
                        connection_class=_Connection,
                        kwargs={
                            **_dead_peer_defaults(self.url),
                            "connect_timeout": max(1, int(self._timeout)),
                            "autocommit": False,
                            # No JIT: every statement here is short, and a cost estimate past jit_above_cost
                            # (a refill's read beside many commands) spent 40 ms compiling a 2 ms read.
                            "options": "-c jit=off",
                        },
                        # No ping per checkout (a round trip on every transaction): a connection that
                        # died is discarded when its transaction fails, and idle ones are recycled.
                        max_idle=60,
                        reconnect_timeout=self._timeout,
                    )
                    self._pid = pid
                    _open.add(self)
        return self._pool

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        """One transaction: committed when the block ends, rolled back on error."""
        with self._connection(autocommit=False) as conn:
            yield conn

    @contextmanager
    def read(self) -> Iterator[psycopg.Connection]:
        """For one read-only statement: no BEGIN/COMMIT round trips around it."""
        with self._connection(autocommit=True) as conn:
            yield conn

    @contextmanager
    def _connection(self, *, autocommit: bool) -> Iterator[psycopg.Connection]:
        held: psycopg.Connection | None = None
        try:
            with self._get_pool().connection() as conn:
                held = conn
                if conn.autocommit != autocommit:
                    conn.autocommit = autocommit
                try:
                    yield conn
                except psycopg.errors.ReadOnlySqlTransaction:
                    # A read-only session stays one (opened on a standby, or while the database was set read-only):
                    # returned closed, the pool replaces it. *Why:* kept, every write on it failed after the primary
                    # took writes again, a finished job's result given up. Only this one: draining the pool at each
                    # refusal reopened every idle connection (8 per refusal) for as long as the refusals lasted.
                    conn.close()
                    raise
        except psycopg.Error as err:
            if held is not None and held.broken and not isinstance(err, _SESSION_OWN_ENDS):
                self._drop_idle()  # (a read-only session closed above is not broken: its pool is left as it is)
            if isinstance(err, _SCHEMA_BEHIND) and self._schema_behind():
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise StoreUnavailable("postgres", self.url, f"{first}: {NOT_MIGRATED}") from err
            if _is_store_error(err):
                detail = str(err).strip() or type(err).__name__
                if isinstance(err, psycopg.errors.LockNotAvailable):  # read as an outage, an operator looked for one
                    detail += f" (a lock held past this wait by {BOOK_HOLDERS})"
                if isinstance(err, psycopg.errors.ReadOnlySqlTransaction):  # read as an outage, as a server down
                    detail += f" ({READ_ONLY})"
                if isinstance(err, PoolTimeout) and self.url in _refusals:
                    detail = f"{detail}; the last attempt to connect: {_refusals[self.url]}"
                raise StoreUnavailable("postgres", self.url, detail) from err
            raise
        except PoolTimeout as err:
            raise StoreUnavailable("postgres", self.url, f"no connection within {self._timeout}s") from err

    def _drop_idle(self) -> None:
        """The pool's idle connections closed (new ones open in the background), after the server ended this one's
        session. *Why:* a restart or a failover ends every session at once, and each idle connection failed its own
        next transaction: a control worker lost a gate pass, a claim or a job's verdict per pooled connection. Not
        checked one by one: a check over a cut network waits on each socket."""
        if self._pool is not None and self._pid == os.getpid():
            self._pool.drain()

    def _schema_behind(self) -> bool:
        """Whether the database lacks a migration this release ships: asked after a missing table or column, which
        is then Postgres not ready; with every migration applied it is a bug, raised as it is."""
        from animastor_tasks.adapters.postgres.migrations import migration_files  # it builds on this module

        try:
            with self._get_pool().connection() as conn:
                row = conn.execute("SELECT max(version) FROM schema_migrations").fetchone()
        except psycopg.errors.UndefinedTable:
            return True
        except (psycopg.Error, PoolTimeout):
            return False
        return int((row or [0])[0] or 0) < max((version for version, _, _ in migration_files()), default=0)

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.close()
        self._pool = None
        _open.discard(self)

    def analyze(self, *tables: str) -> None:
        """Fresh planner statistics of `tables`, after a write that brought many rows of a book they had not seen.

        Why: planned on statistics taken before a book's rows came (one row estimated for it), a join of its
        pairs to their targets or scenes was a nested loop that read them once per pair: a gate pass of a new
        book of 2,000 scenes took 5.6-9.4 s (quadratic in its pairs), on every pass until autovacuum
        analyzed the table, which it never does while the new rows are under a tenth of it. Sampled, so about
        0.15 s at a million rows. Best effort: the write is in, and a failure costs only the plans. It waits half
        a second at most for a table another ANALYZE or a VACUUM holds (an open transaction that analyzed it
        holds it to its end), then gives up rather than hold up the import or the regenerate."""
        try:
            with self.transaction() as conn:
                conn.execute(f"SET LOCAL lock_timeout = '{ANALYZE_LOCK_WAIT_MS}ms'")
                conn.execute(f"ANALYZE {', '.join(tables)}")
        except (psycopg.Error, StoreUnavailable) as err:
            log.warning("[DB] ANALYZE %s failed, plans may be slow until it runs: %s", ", ".join(tables), err)

    def ping(self, within: float | None = None) -> None:
        """`within`: its answer waited for that long at most (`answering_within`), not `ANSWER_LIMIT_S`."""
        with self.transaction() as conn, answering_within(conn, within) if within is not None else nullcontext():
            conn.execute("SELECT 1")
