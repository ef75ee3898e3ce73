"""Small helpers shared by every test folder; the stack of real processes is in `tests.support.stack`,
the private redis-server in `tests.support.private_redis` (both heavier: imported where used)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NoReturn

import pytest

from animastor_tasks.dev.supervisor import SupervisorError, wait_until

from .private_redis import redis_server_executable

__all__ = ["Figures", "missing", "redis_server_executable", "wait_for"]


def wait_for(
    predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition", interval: float = 0.05
) -> Any:
    """Poll until `predicate()` is truthy and return its value; AssertionError naming `what` on timeout."""
    try:
        return wait_until(predicate, timeout, what, interval=interval)
    except SupervisorError as err:
        raise AssertionError(str(err)) from None


def missing(reason: str) -> NoReturn:
    """A tool or service a test needs is absent: a failure in CI (`CI` set), a skip saying so elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must provide it: see .ci/run)")
    pytest.skip(f"{reason} (this fails under CI=true)")


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
