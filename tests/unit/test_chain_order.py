"""A kept job's Flower events keep their order while its predecessor's bookkeeping runs beside its start: what it
says of itself (its progress, its failure) never goes out before its own `task-received` and `task-started`."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from animastor_tasks.flow.job import Job
from animastor_tasks.worker import chain, flower_events
from animastor_tasks.worker.chain import Aftermath

FIRST = Job("b", "ch1", "s1", "audio", "d1", 1)
KEPT = Job("b", "ch1", "s2", "audio", "d2", 1)


@dataclasses.dataclass
class _Ports:
    settings: Any
    publisher: Any
    counters: Any


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The events sent, in order; each but a progress report takes a while (a slow broker)."""
    out: list[tuple[str, str]] = []

    def send_event(task: Any, kind: str, *, hostname: str | None = None, **fields: Any) -> None:
        if kind != "task-progress":
            time.sleep(0.3)
        out.append((kind, fields["uuid"]))

    monkeypatch.setattr(flower_events.Events, "on", True)
    monkeypatch.setattr(flower_events, "send_event", send_event)
    return out


def _run(job: Callable[[Any], dict[str, Any]]) -> None:
    channel = SimpleNamespace(queue_declare=lambda **_: SimpleNamespace(message_count=0))  # nothing waits: kept
    conn = SimpleNamespace(default_channel=channel, channel_errors=())

    @contextmanager
    def acquire(block: bool = True) -> Any:
        yield conn

    backend = SimpleNamespace(mark_as_done=lambda *_: None, mark_as_failure=lambda *_: None)
    task = SimpleNamespace(
        app=SimpleNamespace(pool=SimpleNamespace(acquire=acquire)),
        request=SimpleNamespace(hostname="w@h", id="d1"),
        backend=backend,
        update_state=lambda **_: None,
    )
    settings = SimpleNamespace(chain_budget_seconds=60.0, job_soft_time_limit=1800)
    ports = _Ports(settings, SimpleNamespace(publish_job=lambda *_: None), SimpleNamespace(add=lambda _: None))

    def run(job_ports: Any, current: Job, progress: Any, later: Any) -> dict[str, Any]:
        later.job_started()
        if current is FIRST:
            job_ports.publisher.publish_job("animastor.generate.audio", "gpu.audio", "d2", dataclasses.asdict(KEPT))
            return {"outcome": "ready"}
        return job(progress)

    with contextlib.suppress(RuntimeError):  # the kept job's: its task ends as its predecessor's did
        chain.run_chain(task, ports, "gpu.audio", FIRST, run)  # type: ignore[arg-type]


def test_a_kept_job_that_raises_just_after_its_start_check_is_announced_started_before_failed(sent) -> None:
    def raises(progress: Any) -> dict[str, Any]:
        raise RuntimeError("a store refused the job's first step")

    _run(raises)
    mine = [kind for kind, uuid in sent if uuid == "d2"]
    assert mine == ["task-received", "task-started", "task-failed"], sent


def test_a_kept_job_reports_no_progress_before_its_start_is_announced(sent, monkeypatch) -> None:
    monkeypatch.setattr(flower_events, "PROGRESS_EVERY", 0.0)

    def reports(progress: Any) -> dict[str, Any]:
        for _ in range(12):
            progress(0.5)
            time.sleep(0.1)  # the Sender thread sends each report as it comes
        return {"outcome": "ready"}

    _run(reports)
    mine = [kind for kind, uuid in sent if uuid == "d2"]
    assert mine[:2] == ["task-received", "task-started"] and "task-progress" in mine, sent


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the case
def test_steps_a_dead_aftermath_thread_left_run_when_it_ends() -> None:
    """A held step that raised a BaseException ended the thread; every step given after it waited in its list for
    good."""
    keeper = SimpleNamespace(kept=object())
    aftermath = Aftermath(keeper)  # type: ignore[arg-type]
    ran: list[str] = []
    release = threading.Event()

    def dies() -> None:
        release.wait(5)
        raise SystemExit

    aftermath(dies)
    aftermath.job_started()
    keeper.kept = None
    aftermath(lambda: ran.append("given after"))
    release.set()
    aftermath.finish()
    assert ran == ["given after"]
