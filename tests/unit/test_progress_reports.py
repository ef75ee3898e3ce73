"""A job's progress reaches Flower at most every `PROGRESS_EVERY` seconds from its start; a job done sooner
reports none (its result follows at once): a report of 100% cost every near-instant job a result write and
an event. The reports are sent by a thread of their own: one that waits on a store out of reach holds no
generator."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from animastor_tasks.flow.job import Job
from animastor_tasks.worker import flower_events

JOB = Job("b", "ch1", "s1", "audio", "d1" * 16, 3)


class _Task:
    def __init__(self, hang: threading.Event | None = None) -> None:
        self.states: list[tuple[str, str, float]] = []
        self.request = SimpleNamespace(hostname="gpu@test")
        self.hang = hang

    def update_state(self, task_id: str, state: str, meta: dict[str, Any]) -> None:
        if self.hang is not None:
            self.hang.wait(10)  # a result store out of reach
        self.states.append((task_id, state, meta["percent"]))


def _sent() -> None:
    """Once the progress thread has sent what it was given (it sends in turn)."""
    done = threading.Event()
    flower_events.Sender.send(done.set)
    assert done.wait(10)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(flower_events.time, "monotonic", lambda: now[0])
    return now


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    sent: list[tuple[str, float]] = []
    monkeypatch.setattr(flower_events, "send_event", lambda _task, kind, **kw: sent.append((kind, kw["percent"])))
    return sent


def test_a_job_done_within_the_interval_reports_no_progress(clock: list[float], events: list[Any]) -> None:
    task = _Task()
    report = flower_events.progress_reporter(task, JOB)  # type: ignore[arg-type]
    clock[0] += flower_events.PROGRESS_EVERY / 2
    report(0.5)
    report(1.0)
    _sent()
    assert task.states == [] and events == []


def test_a_long_job_reports_once_per_interval(clock: list[float], events: list[Any]) -> None:
    task = _Task()
    report = flower_events.progress_reporter(task, JOB)  # type: ignore[arg-type]
    for fraction in (0.25, 0.5, 0.75, 1.0):
        clock[0] += flower_events.PROGRESS_EVERY * 0.6  # a report due every other step
        report(fraction)
        _sent()
    assert task.states == [(JOB.dispatch_id, "PROGRESS", 50.0), (JOB.dispatch_id, "PROGRESS", 100.0)]
    assert events == [("task-progress", 50.0), ("task-progress", 100.0)]


def test_a_report_held_up_on_its_way_holds_no_generator_and_the_next_ones_are_left_out(
    clock: list[float], events: list[Any]
) -> None:
    hang = threading.Event()
    task = _Task(hang)
    report = flower_events.progress_reporter(task, JOB)  # type: ignore[arg-type]
    started = time.perf_counter()
    for fraction in (0.25, 0.5, 0.75):
        clock[0] += flower_events.PROGRESS_EVERY
        report(fraction)  # the first waits on the store; the others, due meanwhile, are left out
    assert time.perf_counter() - started < 1.0
    hang.set()
    _sent()
    clock[0] += flower_events.PROGRESS_EVERY
    report(1.0)  # the way is clear again
    _sent()
    assert [percent for _, _, percent in task.states] == [25.0, 100.0]
    assert events == [("task-progress", 25.0), ("task-progress", 100.0)]
