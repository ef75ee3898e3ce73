"""The bookkeeping of a job that a kept job follows runs beside that job's start, never after the task."""

from __future__ import annotations

import threading
from typing import Any

from animastor_tasks.worker.chain import Aftermath


class Keeper:
    kept: Any = None


def test_a_step_runs_at_once_when_no_job_is_kept_to_follow() -> None:
    done: list[str] = []
    Aftermath(Keeper())(lambda: done.append("now"))
    assert done == ["now"]


def test_steps_given_while_a_job_is_kept_wait_for_begin_and_run_in_order_in_another_thread() -> None:
    keeper = Keeper()
    keeper.kept = object()
    aftermath = Aftermath(keeper)
    ran: list[tuple[str, str]] = []
    for name in ("lease", "counter", "result"):
        aftermath(lambda name=name: ran.append((name, threading.current_thread().name)))
    assert ran == []
    aftermath.job_started()
    aftermath.end()
    assert ran == [("lease", "aftermath"), ("counter", "aftermath"), ("result", "aftermath")]


def test_a_failing_step_is_logged_and_the_rest_still_run(caplog) -> None:
    keeper = Keeper()
    keeper.kept = object()
    aftermath = Aftermath(keeper)
    ran: list[str] = []

    def broken() -> None:
        raise ConnectionError("redis down")

    aftermath(broken)
    aftermath(lambda: ran.append("after"))
    aftermath.finish()  # the task ends: what is left runs before it returns
    assert ran == ["after"]
    assert "redis down" in caplog.text


def test_a_step_given_by_a_held_step_runs_at_once_in_the_aftermath_thread() -> None:
    keeper = Keeper()
    keeper.kept = object()
    aftermath = Aftermath(keeper)
    ran: list[str] = []
    aftermath(lambda: aftermath(lambda: ran.append(threading.current_thread().name)))
    aftermath.job_started()
    aftermath.end()
    assert ran == ["aftermath"] and aftermath.steps == []


def test_a_step_given_once_no_job_is_kept_runs_after_the_held_steps_still_running() -> None:
    """The last kept job of a chain ends while its predecessor's bookkeeping (its `task-started` among it) still
    runs: its `task-succeeded` went out first, and Flower saw the job succeed, then start."""
    keeper = Keeper()
    keeper.kept = object()
    aftermath = Aftermath(keeper)
    ran: list[str] = []
    later_given = threading.Event()

    def slow_held_step() -> None:
        later_given.wait(timeout=0.5)  # still running when the next step is given (set by it, on the old code)
        ran.append("held")

    aftermath(slow_held_step)
    aftermath.job_started()
    keeper.kept = None  # nothing more is kept: a step now runs after the held ones

    def given_now() -> None:
        later_given.set()
        ran.append("now")

    aftermath(given_now)
    aftermath.finish()
    assert ran == ["held", "now"]


def test_a_step_given_once_no_job_is_kept_waits_in_the_thread_not_in_the_caller() -> None:
    """The kept job counts its start right after its start check, while its predecessor's bookkeeping still runs: the
    count waited for all of that bookkeeping (its result, Flower's events, its lease), the GPU idle meanwhile."""
    keeper = Keeper()
    keeper.kept = object()
    aftermath = Aftermath(keeper)
    ran: list[tuple[str, str]] = []
    release = threading.Event()

    def slow_held_step() -> None:
        release.wait(timeout=5)
        ran.append(("held", threading.current_thread().name))

    aftermath(slow_held_step)
    aftermath.job_started()
    keeper.kept = None
    aftermath(lambda: ran.append(("counted", threading.current_thread().name)))
    assert ran == []  # the caller went on, the held step still running
    release.set()
    aftermath.finish()
    assert ran == [("held", "aftermath"), ("counted", "aftermath")]


def test_once_the_held_steps_are_over_a_step_runs_at_once_in_the_caller() -> None:
    keeper = Keeper()
    keeper.kept = object()
    aftermath = Aftermath(keeper)
    ran: list[str] = []
    aftermath(lambda: ran.append("held"))
    aftermath.job_started()
    assert aftermath.thread is not None
    aftermath.thread.join()
    keeper.kept = None
    aftermath(lambda: ran.append(threading.current_thread().name))
    assert ran == ["held", threading.current_thread().name]
