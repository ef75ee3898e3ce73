"""The worker's own shutdown steps (no job kept, the running starts noted) run before Celery's handler of each
shutdown signal: a cold shutdown kills the jobs in that handler, before `worker_shutting_down` is sent."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import platforms

from animastor_tasks.worker import lost


def _celerys(calls: list[str], name: str) -> Callable[..., None]:
    def handler(*_: Any) -> None:
        calls.append(name)

    handler.__module__ = "celery.apps.worker"  # as the worker's own (`celery.apps.worker._shutdown_handler`)
    return handler


@pytest.fixture
def installed() -> Iterator[None]:
    """Puts back the handlers the test process had."""
    before = {name: platforms.signals[name] for name in lost.SHUTDOWN_SIGNALS}
    try:
        yield
    finally:
        for name, handler in before.items():
            signal.signal(platforms.signals.signum(name), handler)


def test_the_hook_runs_before_celerys_handler_of_each_shutdown_signal(installed: None) -> None:
    calls: list[str] = []
    for name in lost.SHUTDOWN_SIGNALS:
        platforms.signals[name] = _celerys(calls, name)
    lost.first_on_shutdown_signals(lambda: calls.append("hook"))
    for name in lost.SHUTDOWN_SIGNALS:
        platforms.signals[name](signal.SIGQUIT, None)
    assert calls == ["hook", "SIGTERM", "hook", "SIGQUIT", "hook", "SIGINT"]


def test_celerys_handler_still_shuts_the_worker_down_when_the_hook_fails(installed: None) -> None:
    calls: list[str] = []
    platforms.signals["SIGQUIT"] = _celerys(calls, "cold")

    def hook() -> None:
        raise RuntimeError("store down")

    lost.first_on_shutdown_signals(hook)
    platforms.signals["SIGQUIT"](signal.SIGQUIT, None)
    assert calls == ["cold"]


def test_a_signal_during_the_hook_goes_to_celery_at_once_and_is_handled_once(installed: None) -> None:
    """An operator who signals again while the note waits on a store does not wait for it, and Celery sees one
    shutdown per signal delivered, not the delayed one after the insistent one."""
    calls: list[str] = []
    platforms.signals["SIGQUIT"] = _celerys(calls, "cold")

    def hook() -> None:
        calls.append("hook")
        platforms.signals["SIGQUIT"](signal.SIGQUIT, None)  # the second signal, mid-note

    lost.first_on_shutdown_signals(hook)
    platforms.signals["SIGQUIT"](signal.SIGQUIT, None)
    assert calls == ["hook", "cold"]


def test_a_pool_child_that_inherited_the_handler_runs_no_hook(installed: None, monkeypatch: Any) -> None:
    calls: list[str] = []
    platforms.signals["SIGQUIT"] = _celerys(calls, "cold")
    lost.first_on_shutdown_signals(lambda: calls.append("hook"))
    main = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: main + 1)
    platforms.signals["SIGQUIT"](signal.SIGQUIT, None)
    assert calls == ["cold"]


def test_handlers_not_the_celery_workers_are_left_alone(installed: None) -> None:
    """A worker run in a test's thread installs none: the process's own Ctrl-C must not write shutdown notes."""
    before = platforms.signals["SIGINT"]
    lost.first_on_shutdown_signals(lambda: None)
    assert platforms.signals["SIGINT"] is before


def test_a_store_down_leaves_the_starts_unnoted_without_holding_the_shutdown(settings: Any) -> None:
    """The note runs in the signal handler, before Celery's: a Redis that does not answer must not stop the stop."""
    down = dataclasses.replace(settings, redis_url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    at = time.monotonic()
    lost.note_shutdown(down, "gpu@host")  # never raises
    assert time.monotonic() - at < 10.0


def test_a_remote_shutdown_stops_keeping_and_notes_before_the_worker_stops(monkeypatch: Any) -> None:
    """Flower's Shut Down (`celery control shutdown`) raises `WorkerShutdown` from the control command: no signal
    handler runs and no `worker_shutting_down` is sent, so a job ending then kept its slot's next job and ran it
    in the same task (the drain one whole job longer), and a kill after the grace counted a lost start."""
    from celery.exceptions import WorkerShutdown
    from celery.worker import control

    from animastor_tasks.worker import app, chain

    noted: list[str] = []
    monkeypatch.setattr(lost, "note_shutdown", lambda _settings, node: noted.append(node))
    state = SimpleNamespace(hostname="gpu@host", app=app.app, consumer=None)
    try:
        with pytest.raises(WorkerShutdown):
            control.Panel.data["shutdown"](state, msg="Got shutdown from remote")
        assert not chain.keeping()
    finally:
        chain._shutting_down[0] = 0
    assert noted == ["gpu@host"]
