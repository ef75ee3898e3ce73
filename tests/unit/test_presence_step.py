"""The presence step's warm shutdown: a worker with a job handed to its pool keeps advertising until it is done."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from celery.bootsteps import CLOSE
from celery.worker import state as worker_state

from animastor_tasks.worker.presence import PresenceStep


def _stopping_worker() -> Any:
    return SimpleNamespace(blueprint=SimpleNamespace(state=CLOSE), hostname="gpu@box")


@pytest.mark.parametrize("handed", ["active_requests", "reserved_requests"])
def test_a_worker_stopping_with_a_job_handed_to_its_pool_does_not_withdraw(monkeypatch, handed: str) -> None:
    """A SIGTERM handled after a job was handed to the pool but before its start was reported (the request
    `reserved`, not yet `active`) withdrew the worker at once: the job ran unadvertised, and a stage whose only
    worker that was could be BLOCKED under it, its GPU work thrown away."""
    monkeypatch.setattr(worker_state, handed, {object()})
    step = PresenceStep(_stopping_worker())
    step._advertised = {"gpu.audio"}
    withdrawn: list[Any] = []
    monkeypatch.setattr(step, "_withdraw", lambda parent: withdrawn.append(parent))
    step.stop(_stopping_worker())
    assert withdrawn == [] and step._draining.is_set()


def test_an_idle_worker_stopping_withdraws_at_once(monkeypatch) -> None:
    monkeypatch.setattr(worker_state, "active_requests", set())
    monkeypatch.setattr(worker_state, "reserved_requests", set())
    step = PresenceStep(_stopping_worker())
    withdrawn: list[Any] = []
    monkeypatch.setattr(step, "_withdraw", lambda parent: withdrawn.append(parent))
    step.stop(_stopping_worker())
    assert len(withdrawn) == 1


def test_a_lane_handed_on_at_a_successor_s_first_beat_does_not_hold_up_the_beats(monkeypatch) -> None:
    """The hand-on reads Postgres and publishes refills: run in the heartbeat's own thread, a stall there held the
    next beat past its TTL, and the worker read as gone."""
    from animastor_tasks.worker import presence, wiring

    released = threading.Event()
    ran: list[tuple[set[str], str]] = []

    def stalled(ports: Any, queues: set[str]) -> None:
        ran.append((queues, threading.current_thread().name))
        released.wait(5)

    monkeypatch.setattr(presence.lanes, "consumers_arrived", stalled)
    monkeypatch.setattr(wiring, "current", lambda: SimpleNamespace(ports=object()))
    started = time.monotonic()
    presence._hand_on_awaited({"gpu.audio"})
    assert time.monotonic() - started < 0.5  # the beat goes on
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    released.set()
    assert ran == [({"gpu.audio"}, "animastor-hand-on")]
