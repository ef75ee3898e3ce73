"""Does a store answer, and does its database exist: the questions asked before anything local is started.

Why separate from the local servers: the tests, the benchmarks and the demo ask them of any server, the
configured one included, and create or drop throwaway databases on it.
"""

from __future__ import annotations

import getpass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import redis
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from redis.backoff import NoBackoff
from redis.retry import Retry

from animastor_tasks.config import redis_py_url
from animastor_tasks.errors import StoreUnavailable, redact_url

# libpq messages that mean nothing answered at all (no point in trying another database on the same server).
_NO_SERVER_MARKERS = (
    "connection refused",
    "no such file or directory",
    "timeout expired",
    "could not translate host name",
    "network is unreachable",
    "no route to host",
    "connection timed out",
)


def probe_postgres(url: str, timeout: float = 2.0) -> str | None:
    """None when a PostgreSQL server answers at `url`, else why not.

    A server that answers but lacks the database named in the URL still counts as reachable:
    `ensure_database` can create it. That is checked by connecting to the maintenance database instead.
    libpq rounds a connect timeout below 2 s up to 2 s.
    """
    try:
        _pg_connect(url, timeout).close()
        return None
    except psycopg.Error as err:
        reason = one_line(err)
    if _no_server(reason):
        return reason
    try:
        _pg_connect(make_conninfo(url, dbname="postgres"), timeout).close()
        return None
    except psycopg.Error:
        return reason


def probe_redis(url: str, timeout: float = 2.0) -> str | None:
    """None when a Redis server answers PING at `url` (redis://, rediss://, unix:// or kombu's redis+socket://)."""
    try:
        client = redis.Redis.from_url(
            redis_py_url(url), socket_connect_timeout=timeout, socket_timeout=timeout, retry=no_retry()
        )
    except (ValueError, redis.RedisError) as err:
        return f"invalid Redis URL: {one_line(err)}"
    try:
        client.ping()
    except (redis.RedisError, OSError) as err:
        return one_line(err)
    finally:
        client.close()
    return None


def ensure_database(url: str, timeout: float = 5.0) -> bool:
    """Create the database named in `url` when the server lacks it; True if it was created.

    Why: a reachable server with a missing database is the normal state of a fresh install, and the
    runtime should not need a separate `createdb` step. CREATE DATABASE runs from the `postgres`
    (or `template1`) maintenance database of the same server, with the name quoted as an identifier.
    """
    try:
        dbname = database_name(url)
    except psycopg.Error as err:
        raise StoreUnavailable("postgres", url, f"invalid database URL: {one_line(err)}") from err
    try:
        _pg_connect(url, timeout).close()
        return False
    except psycopg.Error as err:
        first_error = err
    if _no_server(one_line(first_error)):
        raise StoreUnavailable("postgres", url, one_line(first_error)) from first_error
    last_error: psycopg.Error = first_error
    for maintenance in ("postgres", "template1"):
        if maintenance == dbname:
            continue
        try:
            conn = _pg_connect(make_conninfo(url, dbname=maintenance), timeout, autocommit=True)
        except psycopg.Error as err:
            last_error = err
            continue
        try:
            with conn:
                if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone():
                    return False
                try:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
                except psycopg.errors.DuplicateDatabase:
                    return False  # created concurrently by someone else
                return True
        except psycopg.Error as err:
            raise StoreUnavailable("postgres", url, f"cannot create database {dbname!r}: {one_line(err)}") from err
    raise StoreUnavailable("postgres", url, one_line(last_error)) from last_error


def with_database(url: str, dbname: str) -> str:
    """The same server and credentials, another database (tests give each run its own)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(dbname, safe="")))


def drop_database(url: str, timeout: float = 5.0) -> None:
    """Drop the database named in `url` (closing its sessions); a missing one is fine."""
    dbname = database_name(url)
    with _pg_connect(make_conninfo(url, dbname="postgres"), timeout, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))


def database_name(url: str) -> str:
    """The database a libpq URL names, with libpq's fallbacks (the user name, then the login name)."""
    params = conninfo_to_dict(url)
    return str(params.get("dbname") or params.get("user") or getpass.getuser())


def no_retry() -> Retry:
    """redis-py retries failed commands with backoff by default: a probe must answer at once, and a SHUTDOWN
    that closed the connection (its success) must not be resent for seconds."""
    return Retry(NoBackoff(), 0)


def one_line(err: BaseException) -> str:
    """An error as one line, with any password in a URL hidden."""
    text = " ".join(part.strip() for part in str(err).strip().splitlines() if part.strip())
    return redact_url(text or type(err).__name__)


def _no_server(reason: str) -> bool:
    return any(marker in reason.lower() for marker in _NO_SERVER_MARKERS)


def _pg_connect(conninfo: str, timeout: float, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    return psycopg.connect(conninfo, connect_timeout=max(2, round(timeout)), autocommit=autocommit)
