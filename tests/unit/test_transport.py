"""Pure pieces of the shared HTTP transport and the OpenAI generators: Retry-After and the route URL."""

from __future__ import annotations

import email.utils
import time

import pytest

from animastor_tasks.errors import ConfigError
from animastor_tasks.generators.openai_common import route_url
from animastor_tasks.generators.server_words import retry_after_seconds
from animastor_tasks.generators.transport import Limits


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("3", 3.0), (" 1.5 ", 1.5), ("0", 0.0), ("-4", 0.0), (None, None), ("", None), ("soon", None), ("nan", None)],
)
def test_retry_after_delta_seconds(header: str | None, seconds: float | None) -> None:
    assert retry_after_seconds(header) == seconds


def test_a_retry_after_date_past_any_calendar_is_unreadable_not_a_crash() -> None:
    """`parsedate_to_datetime` raises OverflowError for such a year: it escaped as a generator bug (the pair
    failed for good) where an unreadable header means a retryable error."""
    assert retry_after_seconds("Mon, 01 Jan 99999999999999999999 00:00:00 GMT") is None


def test_retry_after_http_date() -> None:
    later = email.utils.formatdate(time.time() + 20, usegmt=True)
    assert retry_after_seconds(later) == pytest.approx(20, abs=2)
    assert retry_after_seconds(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://gpu:8000/v1", "http://gpu:8000/v1/audio/speech"),
        ("http://gpu:8000/v1/", "http://gpu:8000/v1/audio/speech"),
        ("http://gpu:8000/v1/audio/speech", "http://gpu:8000/v1/audio/speech"),
        ("https://gpu/openai/v1?x=1", "https://gpu/openai/v1/audio/speech?x=1"),
    ],
)
def test_route_url_takes_a_base_or_the_full_route(endpoint: str, url: str) -> None:
    assert route_url("audio", "openai-speech", endpoint, "/audio/speech") == url


@pytest.mark.parametrize("endpoint", [None, "", "gpu:8000/v1", "file:///tmp/x"])
def test_route_url_refuses_what_is_not_http(endpoint: str | None) -> None:
    with pytest.raises(ConfigError):
        route_url("audio", "openai-speech", endpoint, "/audio/speech")


def test_limits_read_retry_params_only_when_asked() -> None:
    assert Limits.from_params({"retries": 7}).retries == 0  # the http generator: its params stay the server's
    assert Limits.from_params({"retries": 7}, retries=2).retries == 7
    assert Limits.from_params({}, retries=2) == Limits(retries=2, max_retry_after=30.0)
