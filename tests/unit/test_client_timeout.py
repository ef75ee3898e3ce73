"""`Client(timeout=...)` takes what the CLI's `--timeout` takes, and refuses anything else before it sends."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from animastor_tasks.client import MAX_TIMEOUT, Client
from animastor_tasks.config import Settings
from animastor_tasks.operator.options import WAIT
from tests.unit.test_cli_input import NOWHERE


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Stores nobody listens at: a client that tried to send would fail, not hang."""
    for name, value in NOWHERE.items():
        monkeypatch.setenv(name, value)
    return Settings.from_env()


@pytest.mark.parametrize("timeout", [0, -1, 0.0, math.inf, -math.inf, math.nan, 1e300, 10**400, MAX_TIMEOUT + 0.5])
def test_a_timeout_that_is_no_wait_of_at_most_a_day_is_a_value_error(settings: Settings, timeout: float) -> None:
    """0 and -1 published the command and then said "no answer within 0s" of one that ran; `inf` and `1e300` were
    a raw OverflowError from a socket timeout."""
    with pytest.raises(ValueError, match=r"^timeout: must be above 0 and at most 86,400 seconds, got "):
        Client(settings, timeout=timeout)


@pytest.mark.parametrize("timeout", ["5", None, True, b"5"])
def test_a_timeout_that_is_no_number_is_a_type_error(settings: Settings, timeout: object) -> None:
    """ "5" was a raw TypeError from inside Celery's wait; True was taken as a second."""
    with pytest.raises(TypeError, match=r"^timeout: must be a number of seconds, got "):
        Client(settings, timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [0.3, 5, Fraction(1, 2), MAX_TIMEOUT])
def test_a_wait_above_0_and_at_most_a_day_is_kept_as_seconds(settings: Settings, timeout: float) -> None:
    client = Client(settings, timeout=timeout)
    try:
        assert client.timeout == float(timeout) and isinstance(client.timeout, float)
    finally:
        client.close()


def test_the_cli_timeout_takes_what_the_client_takes() -> None:
    """`regenerate --timeout` and `cancel --timeout` reach the client: one bound for both, not two to drift."""
    assert (WAIT.least, WAIT.open_low, WAIT.most) == (0, True, MAX_TIMEOUT)
