"""Tracing stays off, and importing OpenTelemetry is never attempted, unless asked for; a missing extra is not fatal."""

from __future__ import annotations

import logging
import sys

import pytest

from animastor_tasks.errors import ConfigError
from animastor_tasks.worker import tracing


def test_off_without_the_switch_and_imports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes any import of the name fail: setup must not even try.
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    assert tracing.setup({}) is None
    assert tracing.setup({"ANIMASTOR_OTEL": "0"}) is None
    tracing.on_shutdown()  # nothing set up: a no-op


def test_switch_on_without_the_extra_warns_and_stays_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Celery's own logging set-up in other tests may have disabled or detached this logger.
    logger = logging.getLogger("animastor.worker")
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.WARNING, logger="animastor.worker")
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    assert tracing.setup({"ANIMASTOR_OTEL": "1"}) is None
    assert "otel extra is missing" in caplog.text


@pytest.mark.parametrize("value", ["true", "yes", "on", "2"])
def test_a_switch_value_other_than_0_or_1_names_the_variable(value: str) -> None:
    """`ANIMASTOR_OTEL=true` turned tracing off without a word; the other switches stop the process instead."""
    with pytest.raises(ConfigError, match="ANIMASTOR_OTEL"):
        tracing.wanted({"ANIMASTOR_OTEL": value})
    assert tracing.wanted({"ANIMASTOR_OTEL": " 1 "}) and not tracing.wanted({"ANIMASTOR_OTEL": ""})
