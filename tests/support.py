"""Small helpers shared by every test folder."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


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
