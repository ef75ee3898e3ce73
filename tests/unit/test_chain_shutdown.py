"""A job kept to run next in its predecessor's process is run only while the worker is not shutting down."""

from __future__ import annotations

import dataclasses
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


def test_a_job_kept_just_before_a_warm_shutdown_goes_to_the_broker_rather_than_run_here() -> None:
    """The shutdown was checked only as the refill kept the next job: a SIGTERM landing between that and the kept
    job's start (the rest of the refill and the wind-down) let the process start a whole job after it, which the
    shutdown note had not seen, and the deployment's kill at the end of its grace counted it a lost worker."""
    first = Job("b", "ch1", "s1", "audio", "d1", 1)
    kept = Job("b", "ch1", "s2", "audio", "d2", 1)
    publisher = _Publisher()
    ports = _Ports(SimpleNamespace(chain_budget_seconds=60.0), publisher, SimpleNamespace(add=lambda _: None))
    backend = SimpleNamespace(mark_as_done=lambda *_: None, mark_as_failure=lambda *_: None)
    task = SimpleNamespace(app=_empty_queue_app(), request=SimpleNamespace(hostname="w@h"), backend=backend)
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
