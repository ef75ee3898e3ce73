"""A GPU process whose job ended ready runs its freed slot's next job itself, with no broker hop.

The refill after a ready job already runs in the job's own process (`refill.free_slot`) and claims
the pair the freed slot goes to. Published, that job would wait for the finished task to be
acknowledged and for the worker to fetch the message and hand it to a free child: about as long
again as the claim, while the free GPU is this very process's. So the first job the refill claims
for this process's queue is kept and run here next, as if delivered: the same lease, start check,
fencing and journal. Flower sees it received, started and ended under its own id, and its result
is stored under that id.

A job is kept only
- when no message waits in the queue: a kept job must not overtake one dispatched before it (a lane
  with more slots than worker processes holds a backlog in the broker);
- while the task is younger than `Settings.chain_budget_seconds`: a kept job shares its task's time
  limits;
- unless the worker is shutting down: its running job finishes, and the next one goes to the broker (asked
  again as the kept job is about to start: a SIGTERM between its keeping and its start let a whole job start
  after it, unseen by the shutdown note, `worker/lost.py`);
- unless its job ended in a pause (its node's runs of the queue fail while other nodes' succeed): the process
  waits out a breaker cool-down, and the job kept meanwhile goes to the broker (`Aftermath.pause`).

A job claimed but not run (the task failed after its refill, or the kept job raised before its start
check) is published after all.

The bookkeeping of a job that ended with a job kept to follow it (its lease, counters, result and
Flower's events) is done in a thread while the next job starts (`Aftermath`): the free GPU waits for
none of it, and the task returns only once all of it is done.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
import mmap
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from enum import Enum
from functools import partial
from typing import Any

from celery import Celery, Task

from animastor_tasks.domain.vocabulary import JobOutcome
from animastor_tasks.errors import JobFailed
from animastor_tasks.flow.job import Job, Later, wait_out
from animastor_tasks.ports import Counters, Ports, Publisher
from animastor_tasks.worker import flower_events as events
from animastor_tasks.worker import logs, time_limit, tracing

log = logging.getLogger("animastor.generate")

RunJob = Callable[[Ports, Job, Callable[[float], None], Later], dict[str, Any]]
PAUSE_MARGIN = 5.0  # a pause ends this long before its task's soft time limit at the latest


# One shared byte, mapped before the pool forks: the worker sets it when it starts shutting down, and
# the children running its tasks see it at once (a prefork child hears of a warm shutdown no other way).
_shutting_down = mmap.mmap(-1, 1)


def stop_keeping() -> None:
    """The worker was told to shut down (`app.shutting_down`): no process of it starts another job of its own."""
    _shutting_down[0] = 1


def keeping() -> bool:
    return _shutting_down[0] == 0


class KeepingPublisher:
    """The process's publisher while its job ends: keeps the first job claimed for `queue` (see above)."""

    def __init__(self, inner: Publisher, app: Celery, queue: str, deadline: float) -> None:
        self.inner, self.app, self.queue, self.deadline = inner, app, queue, deadline
        self.kept: Job | None = None
        self.task_name = ""
        self.trace: Any = None  # where the job was claimed: its run continues that trace

    def publish_job(self, task_name: str, queue: str, dispatch_id: str, kwargs: dict[str, Any]) -> None:
        keep = self.kept is None and queue == self.queue and time.monotonic() < self.deadline and keeping()
        if keep and self._none_waits():
            self.kept = Job(**{**kwargs, "fencing_token": int(kwargs["fencing_token"])})
            self.task_name = task_name
            self.trace = tracing.current_context()
            return
        self.inner.publish_job(task_name, queue, dispatch_id, kwargs)

    def _none_waits(self) -> bool:
        """No message ready in the queue (a broker that cannot tell: treat it as one waiting)."""
        try:
            with self.app.pool.acquire(block=True) as conn:
                try:
                    return int(conn.default_channel.queue_declare(queue=self.queue, passive=True).message_count) == 0
                except conn.channel_errors:  # no such queue (Redis drops an empty one): nothing waits
                    return True  # (py-amqp reopens the channel the broker closed with its 404)
        except Exception as err:
            log.debug("[GENERATE] queue %s not counted (%s); the next job is published", self.queue, err)
            return False

    def revoke(self, dispatch_ids: Sequence[str]) -> None:
        self.inner.revoke(dispatch_ids)

    def fail_lost(self, node: str, dispatch_ids: Sequence[str], why: str) -> None:
        self.inner.fail_lost(node, dispatch_ids, why)

    def enqueue_refill(self, book_id: str, *args: Any, **kwargs: Any) -> None:
        self.inner.enqueue_refill(book_id, *args, **kwargs)  # as the publisher takes it

    def enqueue_gates(self, book_ids: Sequence[str]) -> None:
        self.inner.enqueue_gates(book_ids)


def run_chain(task: Task, ports: Ports, queue: str, first: Job, run: RunJob) -> dict[str, Any]:
    """Run `first`, then each job its freed slot was kept for here; `first`'s result is the task's."""
    deadline = time.monotonic() + ports.settings.chain_budget_seconds
    keeper = KeepingPublisher(ports.publisher, task.app, queue, deadline)
    aftermath = Aftermath(keeper, time.monotonic() + ports.settings.job_soft_time_limit)
    try:
        began = time.monotonic()
        try:
            result = run(_job_ports(ports, keeper, aftermath), first, events.progress_reporter(task, first), aftermath)
        except BaseException:
            _quietly_publish(ports.publisher, keeper.task_name, queue, keeper.kept)
            raise
        if keeper.kept is not None:
            # Succeeded now, with its successor's start, not when the task returns after the chain. *Why:* Flower and
            # the result store said PROGRESS for the whole chain (up to its budget), and for good after a kill.
            _succeeded(task, first, result, time.monotonic() - began, aftermath)
        while keeper.kept is not None:
            job, name, trace = keeper.kept, keeper.task_name, keeper.trace
            if not keeping():  # the worker began shutting down after the job was kept: not started here
                _quietly_publish(ports.publisher, name, queue, job)
                break
            fields = dataclasses.asdict(job)
            # Held back, they run in another thread, where Celery's request (and the worker's name) is not set.
            worker = events.worker_name(task)
            aftermath(
                partial(
                    events.announce,
                    task,
                    "task-received",
                    job.dispatch_id,
                    hostname=worker,
                    name=name,
                    args="()",
                    kwargs=repr(fields),
                    retries=0,
                )
            )
            aftermath(partial(events.announce, task, "task-started", job.dispatch_id, hostname=worker))  # with its pid
            # Held back until the job has passed its start check, with its predecessor's bookkeeping.
            keeper = aftermath.keeper = KeepingPublisher(ports.publisher, task.app, queue, deadline)
            aftermath.started = False
            with logs.job_context(task.request.id or "", fields):  # its lines carry its own ids, not the task's
                ran = _run_kept(task, _job_ports(ports, keeper, aftermath), job, name, trace, run, aftermath)
            aftermath.end()
            if not ran:
                if not aftermath.started:  # its delivery never began (a store did not answer): the broker's again
                    _quietly_publish(ports.publisher, name, queue, job)
                _quietly_publish(ports.publisher, keeper.task_name, queue, keeper.kept)
                break
    finally:
        aftermath.finish()
    if result.get("outcome") == JobOutcome.FAILED:  # its verdict is written: Celery marks the task failed
        raise _failure(first, result)
    return result


def _failure(job: Job, outcome: dict[str, Any]) -> JobFailed:
    """What a job whose scene failed ends with. *Why:* Flower and the result store showed it SUCCESS."""
    return JobFailed(f"{job.book_id}/{job.chapter_id}/{job.scene_id} {job.stage}", str(outcome.get("error")))


def _job_ports(ports: Ports, keeper: KeepingPublisher, aftermath: Aftermath) -> Ports:
    return dataclasses.replace(ports, publisher=keeper, counters=HeldCounters(ports.counters, aftermath))


class HeldCounters:
    """The process's counters while its job runs: a count made once a job is kept to follow (the refill's
    outcomes, its pass time) is held back with the rest of the bookkeeping, off that job's start."""

    def __init__(self, inner: Counters, later: Later) -> None:
        self.inner, self.later = inner, later

    def add(self, counts: Mapping[str, int]) -> None:
        self.later(partial(self.inner.add, dict(counts)))

    def observe(self, name: str, seconds: float) -> None:
        self.later(partial(self.inner.observe, name, seconds))


class Aftermath(Later):
    """`job.Later` for a chain: a step given while a job is kept to run next is held back until that
    job has passed its start check, then run in a thread beside it; any other step runs at once, or, while the held
    steps still run, after them in their thread. A job's verdict is written with the task's soft time limit held back
    (`time_limit.soft_limit_held`)."""

    def __init__(self, keeper: KeepingPublisher, soft_limit_at: float = math.inf) -> None:
        self.keeper = keeper
        self.soft_limit_at = soft_limit_at  # when the task's soft time limit fires (`time.monotonic`)
        self.steps: list[Callable[[], object]] = []
        self.thread: threading.Thread | None = None
        self.started = False  # the current job's start check is over
        self._running: list[Callable[[], object]] | None = None  # what the thread has still to run; None: it is over
        self._lock = threading.Lock()

    def __call__(self, step: Callable[[], object]) -> None:
        if threading.current_thread() is self.thread:  # a held step's own: now
            step()
        elif self.keeper.kept is not None:  # run in the context it was given in: its lines are its own job's
            self.steps.append(partial(contextvars.copy_context().run, step))
        elif not self._behind_the_held(step):
            step()

    def _behind_the_held(self, step: Callable[[], object]) -> bool:
        """While the held steps still run, a step given once no job is kept runs after them, in their thread: a job's
        `task-succeeded` never goes out before its `task-started`. *Why not waited for:* the kept job counts its start
        right after its start check, and that count waited for all of its predecessor's bookkeeping (its result,
        Flower's events, its lease) before the job's own work began, its GPU idle meanwhile."""
        with self._lock:
            if self._running is None:
                return False
            self._running.append(partial(contextvars.copy_context().run, step))
            return True

    def writing_verdict(self, job: Job) -> AbstractContextManager[object]:
        return time_limit.soft_limit_held(job.describe())

    def pause(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        """The job kept to follow goes to the broker (a healthy host's process runs it meanwhile), the held
        bookkeeping is done, then the task waits out `seconds` (or until `until()`): ended by a warm shutdown (the
        worker's exit is not held), and before the task's soft time limit (which, fired in the wait, failed the
        task)."""
        kept, self.keeper.kept = self.keeper.kept, None
        _quietly_publish(self.keeper.inner, self.keeper.task_name, self.keeper.queue, kept)
        self.finish()
        wait_out(min(time.monotonic() + seconds, self.soft_limit_at - PAUSE_MARGIN), until, keeping)

    def job_started(self) -> None:
        self.started = True
        if not self.steps or self.thread is not None:
            return
        self._running, self.steps = self.steps, []
        self.thread = threading.Thread(target=self._run_held, name="aftermath", daemon=True)
        self.thread.start()

    def holding(self) -> bool:
        """Whether the thread still has steps to run (its own job's announcements among them)."""
        with self._lock:
            return self._running is not None

    def _run_held(self) -> None:
        while True:
            with self._lock:
                if not self._running:
                    self._running = None
                    return
                step = self._running.pop(0)
            _run_steps((step,))

    def end(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        with self._lock:  # left by a thread a BaseException ended: run here rather than lost with it
            left, self._running = self._running or [], None
        _run_steps(left)

    def finish(self) -> None:
        """Before the task returns or raises: every step given is done."""
        self.end()
        steps, self.steps = self.steps, []
        _run_steps(steps)


def _run_steps(steps: Sequence[Callable[[], object]]) -> None:
    for step in steps:
        try:
            step()
        except Exception as err:  # bookkeeping: a store that fails is logged, as by job.quietly
            log.warning("[GENERATE] bookkeeping after a job skipped: %s: %s", type(err).__name__, err)


def _run_kept(task: Task, ports: Ports, job: Job, name: str, trace: Any, run: RunJob, later: Aftermath) -> bool:
    """A kept job, recorded under its own id like a delivered one; False when it raised (recorded as failed only
    once its start check was over: one that raised before is published again, and runs under the same id)."""
    started = time.monotonic()
    try:
        with tracing.span(f"run/{name}", trace, **{"celery.task_name": name, "messaging.message.id": job.dispatch_id}):
            outcome = run(ports, job, _once_announced(events.progress_reporter(task, job), later), later)
    except Exception as err:
        if not later.started:
            log.warning("[GENERATE] %s could not start in its predecessor's task (%s); published", job.describe(), err)
            return False
        log.exception("[GENERATE] %s raised in its predecessor's task", job.describe())
        later.end()  # its `task-received` and `task-started`, held with its predecessor's bookkeeping, go out first
        events.announce(task, "task-failed", job.dispatch_id, exception=repr(err), traceback=traceback.format_exc())
        _record(task.backend.mark_as_failure, job.dispatch_id, err)
        return False
    if outcome.get("outcome") == JobOutcome.FAILED:
        failed = _failure(job, outcome)
        later(partial(events.announce, task, "task-failed", job.dispatch_id, exception=repr(failed), traceback=""))
        later(partial(_record, task.backend.mark_as_failure, job.dispatch_id, failed))
    else:
        _succeeded(task, job, outcome, time.monotonic() - started, later)
    _record(ports.counters.add, {f"job:kept:{job.stage}": 1})  # animastor_jobs_total{event="kept"}; held, as the rest
    return True


def _once_announced(report: Callable[[float], None], later: Aftermath) -> Callable[[float], None]:
    """A kept job's progress, none of it while its `task-received` and `task-started` (held with its predecessor's
    bookkeeping) may still be on their way: a report due meanwhile is left out, as one due while the report before
    is (`flower_events.progress_reporter`). *Why:* Flower got the job's progress before it knew the job had started."""

    def reported(fraction: float) -> None:
        if not later.holding():
            report(fraction)

    return reported


def _succeeded(task: Task, job: Job, outcome: dict[str, Any], runtime: float, later: Aftermath) -> None:
    """A job of the chain succeeded: its event and its result, held back with the rest of its bookkeeping."""
    # Shown as a delivered job's result is (its values as JSON carried them): a search of Flower for `'outcome':
    # 'ready'` missed the kept jobs, shown `<JobOutcome.READY: 'ready'>`.
    shown = {key: value.value if isinstance(value, Enum) else value for key, value in outcome.items()}
    succeeded = {"result": repr(shown), "runtime": runtime, "hostname": events.worker_name(task)}
    later(partial(events.announce, task, "task-succeeded", job.dispatch_id, **succeeded))
    later(partial(_record, task.backend.mark_as_done, job.dispatch_id, outcome))


def _record(store: Callable[..., Any], *args: Any) -> None:
    """Bookkeeping of a kept job that ran (its result, a counter): a store that fails is logged, nothing more."""
    try:
        store(*args)
    except Exception as err:
        log.warning("[GENERATE] %s not recorded: %s", args[0], err)


def _quietly_publish(publisher: Publisher, task_name: str, queue: str, job: Job | None) -> None:
    """A job claimed here but not run here (if any) to the broker after all."""
    if job is None:
        return
    try:
        publisher.publish_job(task_name, queue, job.dispatch_id, dataclasses.asdict(job))
    except Exception as err:  # its queued lease lapses through reconcile: the broker never held it
        log.warning("[GENERATE] kept job not published (%s); reconcile takes it over", err)
