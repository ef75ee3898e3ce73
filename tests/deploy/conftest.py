"""Deployment figures (time to healthy, the whole test, which images are stand-ins): each printed as taken
and repeated in the terminal summary, so that a CI log shows them without -s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.support import Figures

FIGURES = Figures()


@pytest.fixture(scope="module")
def figure() -> Callable[[str], None]:
    def record(line: str) -> None:
        print(line)
        FIGURES.lines.append(line)

    return record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    FIGURES.summarize(terminalreporter, "deployment figures")
