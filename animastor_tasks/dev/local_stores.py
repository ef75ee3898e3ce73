"""Embedded PostgreSQL and Redis under one data directory, started once and found again through state.json.

Why a state file: the servers are daemons in their own sessions, so they outlive the command that started
them; state.json (pids, sockets, versions) lets a later command reuse them, restart them after a reboot,
or stop them. A lock file serialises start and stop between processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from animastor_tasks.dev.local_dir import default_data_dir
from animastor_tasks.dev.local_postgres import DEFAULT_DATABASE, LocalPostgres, postgres_url
from animastor_tasks.dev.local_redis import LocalRedis, broker_url, redis_url
from animastor_tasks.dev.probes import ensure_database

DATABASE_VAR = "ANIMASTOR_DATABASE_URL"
REDIS_VAR = "ANIMASTOR_REDIS_URL"
BROKER_VAR = "ANIMASTOR_BROKER_URL"

_STATE_VERSION = 1


class LocalStores:
    """The local servers of one data directory.

    Layout: `pg/` (PGDATA, also the socket directory when its path is short enough), `redis/` (config, pid file,
    log, socket), `state.json` (pids, sockets, versions), `env` (written by `up`), `.lock` (serialises start/stop).
    """

    def __init__(self, data_dir: Path | None = None) -> None:
        self.data_dir = Path(os.path.abspath((data_dir or default_data_dir()).expanduser()))
        self.state_path = self.data_dir / "state.json"
        self.env_path = self.data_dir / "env"
        self.postgres = LocalPostgres(self.data_dir)
        self.redis = LocalRedis(self.data_dir)
        #: What the last `start()` did per store ("started embedded PostgreSQL 18 on ... (socket)", ...).
        self.notes: dict[str, str] = {}

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
                entry, note = self.postgres.ensure(state.get("postgres"))
                entry["database"] = database
                state["postgres"] = entry
                self._write_state(state)
                url = postgres_url(entry["socket_dir"], database)
                if ensure_database(url):
                    note += f"; created database {database!r}"
                self.notes["postgres"] = note
                env[DATABASE_VAR] = url
            if redis:
                entry, note = self.redis.ensure(state.get("redis"))
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
            return self.postgres.stop(pg) if pg else "postgres: no embedded server recorded"

    def env(self) -> dict[str, str]:
        """The environment for the local servers that are running now (empty when none is)."""
        state = self._read_state()
        env: dict[str, str] = {}
        pg = state.get("postgres")
        if pg and self.postgres.alive(pg):
            env[DATABASE_VAR] = postgres_url(pg["socket_dir"], pg.get("database", DEFAULT_DATABASE))
        rd = state.get("redis")
        if rd and self.redis.alive(rd):
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
            if pg is None and (self.postgres.pgdata / "postmaster.pid").exists():
                pg = self.postgres.entry_from_pidfile()  # started but state never written (killed mid-start)
            if pg is not None:
                lines.append(self.postgres.stop(pg))
            rd = state.get("redis")
            if rd is None:
                rd = self.redis.entry_from_pidfile()
            if rd is not None:
                lines.append(self.redis.stop(rd))
            for entry in (pg, rd):
                extra = (entry or {}).get("private_dir")
                if extra:
                    shutil.rmtree(extra, ignore_errors=True)
            for path in (*self.postgres.data_folders(), self.redis.redis_dir):
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
