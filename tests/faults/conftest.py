"""Fault-injection fixtures: the e2e stack (real workers and beat on a private redis-server), the scale knob
and the figures every fault test prints.

The stack, the private Redis and the failure-log hook are the e2e ones, imported (not copied):
a faults test builds its cluster with `make_stack` exactly as an e2e test does. What is added
here: `redis_down_ok` (a test that stops or restarts the private redis-server gets it back
running afterwards, whatever happened), `scale` (`ANIMASTOR_FAULT_SCALE=long`, used by
`make faults`, raises trial counts and outage lengths) and `figure`, which records one line per
test (trials, lost, duplicated, time to recover) and repeats them in the terminal summary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.conftest import (  # noqa: F401  (fixtures and the report hook, reused as they are)
    amqp_broker,
    make_stack,
    private_redis,
    pytest_runtest_makereport,
    redis_server,
)
from tests.support import Figures
from tests.support.private_redis import PrivateRedis

from .scale import Scale
from .scale import current as current_scale

FIGURES = Figures()


@pytest.fixture(scope="session")
def scale() -> Scale:
    try:
        return current_scale()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    FIGURES.summarize(terminalreporter, f"fault figures (scale {current_scale().name})")


@pytest.fixture
def figure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record a measured figure line: printed now and in the terminal summary."""
    return FIGURES.recorder(request)


@pytest.fixture
def redis_down_ok(redis_server: PrivateRedis) -> Iterator[PrivateRedis]:  # noqa: F811 (the fixture)
    """The private redis-server, for a test that stops, kills or restarts it: running again afterwards."""
    yield redis_server
    if not redis_server.running():
        redis_server.start()
