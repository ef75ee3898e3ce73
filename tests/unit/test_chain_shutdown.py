"""A job kept to run next in its predecessor's process is run only while the worker is not shutting down, and a
process whose job asked for a pause (its host's runs fail while others' succeed) runs no job meanwhile."""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from animastor_tasks.flow.job import Job
from animastor_tasks.worker import chain


class _Publisher:
    def __init__(self) -> None:
        self.published: list[str] = []

    def publish_job(self, task_name: str, queue: str, dispatch_id: str, kwargs: dict[str, Any]) -> None:
        self.published.append(dispatch_id)


@dataclasses.dataclass
class _Ports:
    settings: Any
    publisher: Any
    counters: Any


def _empty_queue_app() -> Any:
    """A Celery app whose broker says no message waits in the queue (so a job may be kept)."""
    channel = SimpleNamespace(queue_declare=lambda **_: SimpleNamespace(message_count=0))
    conn = SimpleNamespace(default_channel=channel, channel_errors=())

    @contextmanager
    def acquire(block: bool = True) -> Any:
        yield conn

    return SimpleNamespace(pool=SimpleNamespace(acquire=acquire))


def _chain(publisher: _Publisher, soft_time_limit: float = 1800) -> tuple[_Ports, Any]:
    settings = SimpleNamespace(chain_budget_seconds=60.0, job_soft_time_limit=soft_time_limit)
    ports = _Ports(settings, publisher, SimpleNamespace(add=lambda _: None))
    backend = SimpleNamespace(mark_as_done=lambda *_: None, mark_as_failure=lambda *_: None)
    return ports, SimpleNamespace(app=_empty_queue_app(), request=SimpleNamespace(hostname="w@h"), backend=backend)


def test_a_job_kept_just_before_a_warm_shutdown_goes_to_the_broker_rather_than_run_here() -> None:
    """The shutdown was checked only as the refill kept the next job: a SIGTERM landing between that and the kept
    job's start (the rest of the refill and the wind-down) let the process start a whole job after it, which the
    shutdown note had not seen, and the deployment's kill at the end of its grace counted it a lost worker."""
    first = Job("b", "ch1", "s1", "audio", "d1", 1)
    kept = Job("b", "ch1", "s2", "audio", "d2", 1)
    publisher = _Publisher()
    ports, task = _chain(publisher)
    ran: list[str] = []

    def run(job_ports: Any, job: Job, progress: Any, later: Any) -> dict[str, Any]:
        ran.append(job.dispatch_id)
        if job is first:
            job_ports.publisher.publish_job("animastor.generate", "gpu.audio", "d2", dataclasses.asdict(kept))
            assert job_ports.publisher.kept == kept  # kept to run here next
            chain.stop_keeping()  # SIGTERM, after the keep
        return {"outcome": "ready"}

    try:
        result = chain.run_chain(task, ports, "gpu.audio", first, run)  # type: ignore[arg-type]
    finally:
        chain._shutting_down[0] = 0
    assert result == {"outcome": "ready"}
    assert ran == ["d1"] and publisher.published == ["d2"]


def _pausing(seconds: float, ran: list[str], bookkept: list[float]) -> Any:
    """A run whose first job keeps the next one, holds a step of bookkeeping, then asks for a pause."""
    first, kept = Job("b", "ch1", "s1", "audio", "d1", 1), Job("b", "ch1", "s2", "audio", "d2", 1)

    def run(job_ports: Any, job: Job, progress: Any, later: Any) -> dict[str, Any]:
        ran.append(job.dispatch_id)
        if job == first:
            job_ports.publisher.publish_job("animastor.generate", "gpu.audio", "d2", dataclasses.asdict(kept))
            assert job_ports.publisher.kept == kept
            later(lambda: bookkept.append(time.monotonic()))  # held for the kept job's start
            bookkept.append(time.monotonic())
            later.pause(seconds)
        return {"outcome": "given_back"}

    return first, run


def test_a_process_that_pauses_runs_no_job_meanwhile_and_sends_the_one_kept_to_the_broker() -> None:
    """Its host's runs fail while others' succeed: the job kept to follow goes to a well host through the broker,
    the held bookkeeping (its lease, its delivery's end) is done at once, and the task returns once the pause is
    over (Celery gives its process no job before then)."""
    publisher, ran, bookkept = _Publisher(), [], []  # type: ignore[var-annotated]
    ports, task = _chain(publisher)
    first, run = _pausing(0.5, ran, bookkept)
    started = time.monotonic()
    result = chain.run_chain(task, ports, "gpu.audio", first, run)  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.5
    assert result == {"outcome": "given_back"} and ran == ["d1"] and publisher.published == ["d2"]
    asked, held = bookkept
    assert held - asked < 0.5  # before the wait, not after it


def test_a_pause_ends_on_a_warm_shutdown_and_before_the_tasks_soft_time_limit() -> None:
    for soft_limit, stop in ((1800, True), (6, False)):  # the pause ends 5 s before the soft limit at the latest
        publisher = _Publisher()
        ports, task = _chain(publisher, soft_time_limit=soft_limit)
        first, run = _pausing(60, [], [])
        if stop:
            threading.Timer(0.2, chain.stop_keeping).start()
        started = time.monotonic()
        try:
            chain.run_chain(task, ports, "gpu.audio", first, run)  # type: ignore[arg-type]
        finally:
            chain._shutting_down[0] = 0
        assert time.monotonic() - started < 10 and publisher.published == ["d2"]
