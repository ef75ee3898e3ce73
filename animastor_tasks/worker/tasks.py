"""Thin Celery tasks: the public, versioned contract. Each calls one flow.

| task                        | queue               | kwargs                                                      |
| --------------------------- | ------------------- | ----------------------------------------------------------- |
| animastor.regenerate        | animastor.control   | book_id, stages, scenes=None, command_id=None, force=True,  |
|                             |                     | priority=None (interactive, normal or bulk)                 |
| animastor.cancel            | animastor.control   | book_id, reason=None                                        |
| animastor.gate              | animastor.control   | book_id, lane=None (set: a refill of that lane, as below)   |
| animastor.refill            | animastor.control   | book_id, lane=None (the queue whose free slot it is handed; |
|                             |                     | None: any; sent when a slot frees), freed=None (the lane of |
|                             |                     | the one slot freed, when no book was waiting for it),       |
|                             |                     | slots=None (how many free slots of `lane` it is handed),    |
|                             |                     | batch=None (the hand-over to several books it is one of)    |
| animastor.gate_batch        | animastor.control   | book_ids (the due books; sent by the tick)                  |
| animastor.tick              | animastor.control   | (none; beat)                                                |
| animastor.reconcile         | animastor.control   | (none; beat)                                                |
| animastor.generate.<stage>  | the stage's queue   | book_id, chapter_id, scene_id, stage, dispatch_id,          |
|                             |                     | fencing_token (its process may run the next job of its      |
|                             |                     | freed slot in the same task: worker/chain.py)               |

The tasks only this runtime sends (all but regenerate, cancel and gate) take, and log, kwargs they do not know:
a newer version's message to an older worker during a rolling deploy runs rather than failing with a
TypeError (a refill lost so left its slot idle until reconcile). The three a caller sends refuse one: it is
the caller's intent (a misspelt `lane` ran a whole gate pass). The runtime's own refuse a kwarg of another type
than they are sent (`_as_sent`), a required one missing (`SignedTask`) and a value no sender of theirs sends (a
refill handed more slots than a lane may have, a gate_batch of more books than a tick sends).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
from collections.abc import Callable
from typing import Any

from celery import Task
from celery.exceptions import Reject

from animastor_tasks.domain.book import show_value, validate_id
from animastor_tasks.domain.liveness import delivery_holder
from animastor_tasks.domain.registry import CONTROL_QUEUE, MOST, SENT_AT_HEADER, StageSpec
from animastor_tasks.errors import DeliveryNotStarted, InvalidCommand, JobFailed
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, lanes, refill, validate
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.flow.job import Job, Later
from animastor_tasks.ports import Ports
from animastor_tasks.worker import chain, wiring
from animastor_tasks.worker.app import app, settings
from animastor_tasks.worker.lost import GenerateRequest

log = logging.getLogger("animastor.worker")
MOST_BATCHED = 20 * lanes.BATCH_BOOKS  # book ids one gate_batch takes: what the tick sends, and room for a newer one


def ports() -> Ports:
    return wiring.current().ports


def _newer(task: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        log.warning("[WORKER] %s: ignored %s, sent by a newer version", task, ", ".join(sorted(kwargs)))


MISSING: Any = object()  # a required argument the message lacks


def _call_as_schema_says(task: str, unknown: dict[str, Any], **required: Any) -> None:
    """A call its schema refuses (a required argument missing, one it does not name) is the `InvalidCommand` it
    says, before anything is read or written. *Why:* Python's own TypeError reached the caller as a bare
    TypeError. An argument this version does not know is refused, not ignored: it is a caller's intent."""
    missing = sorted(name for name, value in required.items() if value is MISSING)
    if missing:
        raise InvalidCommand(f"{task}: missing required argument(s) {', '.join(missing)}")
    if unknown:
        raise InvalidCommand(f"{task}: unknown argument(s) {', '.join(sorted(unknown))}")


def _as_sent(task: str, **fields: tuple[object, Any]) -> None:
    """The kwargs of a task only this runtime sends are of the types it sends them in, or the message is refused as
    an `InvalidCommand` naming the field, before anything is read. *Why:* a hand-written one failed deep inside
    (`operator does not exist: text = smallint`, `unhashable type: 'list'`), and a string of book ids was passed as a
    book per character."""
    for name, (value, kind) in fields.items():
        kinds = getattr(kind, "__args__", (kind,))  # `str | None`: (str, NoneType)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # True is an int too
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise InvalidCommand(f"{task}: {name} must be {names}, got {show_value(value)}")


class SignedTask(Task):
    """A call its signature cannot take (a required argument missing, more positional arguments than it has, one
    given twice) is the `InvalidCommand` it says, before anything runs. *Why:* Python's own TypeError reached the
    caller, or the log, as a bare TypeError."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            _signature(self).bind(*args, **kwargs)
        except TypeError as err:
            raise InvalidCommand(f"{self.name}: {err}") from None
        return super().__call__(*args, **kwargs)


class CallerTask(SignedTask):
    """A task other services send: one sent to another queue than the control queue is the `InvalidCommand` it says,
    before anything runs. *Why:* a Stop All sent to a GPU queue ran on a GPU worker behind that lane's backlog (15 s
    in a hunt, hours with real jobs), jobs starting meanwhile. Each refusal is `throws`: the caller's error, logged at
    INFO without a traceback (a caller could fill the error log with them)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        queue = (self.request.delivery_info or {}).get("routing_key")
        if queue is not None and queue != CONTROL_QUEUE:  # none: called in process, not delivered
            raise InvalidCommand(
                f"{self.name}: sent to queue {show_value(queue)}; send it to {CONTROL_QUEUE!r}, the control workers'"
            )
        return super().__call__(*args, **kwargs)


@functools.cache
def _signature(task: Task) -> inspect.Signature:
    return inspect.signature(task.run)


@app.task(name="animastor.regenerate", base=CallerTask, throws=(InvalidCommand,))
def regenerate(
    book_id: Any = MISSING,
    stages: Any = MISSING,
    scenes: list[list[str]] | None = None,
    command_id: str | None = None,
    force: bool = True,
    priority: str | None = None,
    **unknown: Any,
) -> dict[str, Any]:
    _call_as_schema_says("animastor.regenerate", unknown, book_id=book_id, stages=stages)
    sent_at = _sent_at(regenerate.request)
    return regenerate_flow.regenerate(ports(), book_id, stages, scenes, command_id, force, priority, sent_at)


@app.task(name="animastor.cancel", base=CallerTask, throws=(InvalidCommand,))
def cancel(book_id: Any = MISSING, reason: str | None = None, **unknown: Any) -> dict[str, Any]:
    _call_as_schema_says("animastor.cancel", unknown, book_id=book_id)
    return cancel_flow.cancel(ports(), book_id, reason, _sent_at(cancel.request))


def _sent_at(request: Any) -> float | None:
    """When the caller sent the command (`SENT_AT_HEADER`, the client's stamp); None without one, or one that is no
    time (a hand-made message's: ignored, as the header is no part of the kwargs)."""
    stamp = getattr(request, SENT_AT_HEADER, None)
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp):
        return None
    return float(stamp)


@app.task(name="animastor.gate", base=CallerTask, throws=(InvalidCommand,))
def gate_task(book_id: Any = MISSING, lane: str | None = None, **unknown: Any) -> dict[str, Any]:
    # Sent by callers only (the runtime hands slots through animastor.refill): held to its schema, as regenerate.
    _call_as_schema_says("animastor.gate", unknown, book_id=book_id)
    # `lane`: a message of a version that handed slots through this task; handed slots are refills now.
    book, queue = validate.known_book(ports(), book_id), validate.lane(ports(), lane)
    return _pass_result(book, gate.gate_pass(ports(), book) if queue is None else refill.refill(ports(), book, queue))


@app.task(name="animastor.refill", base=SignedTask, ignore_result=True)
def refill_task(
    book_id: str,
    lane: str | None = None,
    freed: str | None = None,
    slots: int | None = None,
    batch: str | None = None,
    **newer: Any,
) -> dict[str, Any]:
    _newer("animastor.refill", newer)
    optional = str | None
    _as_sent("animastor.refill", book_id=(book_id, str), lane=(lane, optional), freed=(freed, optional),
             slots=(slots, int | None), batch=(batch, optional))  # fmt: skip
    validate_id("book_id", book_id, error=InvalidCommand)  # *why:* a NUL in it was a psycopg traceback at ERROR
    if slots is not None and not 1 <= slots <= MOST:  # *why:* 1e30 failed in a Redis script, as 'redis unavailable'
        raise InvalidCommand(f"animastor.refill: slots must be from 1 to {MOST:,}, got {show_value(slots)}")
    if slots is not None and lane is not None:  # handed that many free slots of `lane` (`batch`: with other books)
        report = refill.refill(ports(), book_id, lane, slots_of=lane, slots=slots, batch=batch)
    else:
        report = refill.refill(ports(), book_id, lane, slots_of=freed)
    return _pass_result(book_id, report)


def _pass_result(book_id: str, report: gate.PassReport) -> dict[str, Any]:
    return {
        "book_id": book_id,
        "authorized": report.authorized_count,
        "released": len(report.released),
        "outcomes": dict(report.outcomes),
        "error": report.error,
    }


@app.task(name="animastor.gate_batch", base=SignedTask, ignore_result=True)
def gate_batch(book_ids: list[str], **newer: Any) -> int:
    _newer("animastor.gate_batch", newer)
    _as_sent("animastor.gate_batch", book_ids=(book_ids, list))
    if len(book_ids) > MOST_BATCHED:  # *why:* 100,000 held a control process 40 s, a warning line for each
        raise InvalidCommand(f"animastor.gate_batch: at most {MOST_BATCHED} book ids, got {len(book_ids):,}")
    _as_sent("animastor.gate_batch", **{f"book_ids[{n}]": (book, str) for n, book in enumerate(book_ids)})
    for n, book in enumerate(book_ids):  # *why:* a NUL in one was a psycopg traceback at ERROR
        validate_id(f"book_ids[{n}]", book, error=InvalidCommand)
    return len(gate.gate_batch(ports(), list(dict.fromkeys(book_ids))))  # a book named twice is passed once


@app.task(name="animastor.tick", base=SignedTask, ignore_result=True)
def tick(**newer: Any) -> list[str]:
    _newer("animastor.tick", newer)
    return gate.tick(ports())


@app.task(name="animastor.reconcile", base=SignedTask, ignore_result=True)
def reconcile(**newer: Any) -> dict[str, Any]:
    _newer("animastor.reconcile", newer)
    return reconcile_flow.reconcile(ports())


def _register_generate(spec: StageSpec) -> None:
    @app.task(
        name=spec.task_name,
        base=SignedTask,
        bind=True,
        acks_late=True,
        reject_on_worker_lost=True,
        Request=GenerateRequest,  # a job whose pool process dies is let go at once (worker/lost.py)
        throws=(JobFailed,),  # a scene failed for good: FAILURE for Flower, at INFO (its job's line is the ERROR)
        soft_time_limit=settings.job_soft_time_limit,
        time_limit=settings.job_time_limit,
    )
    def generate(
        self: Task,
        book_id: str,
        chapter_id: str,
        scene_id: str,
        stage: str,
        dispatch_id: str,
        fencing_token: int,
        **newer: Any,
    ) -> dict[str, Any]:
        _newer(spec.task_name, newer)
        ids = {"book_id": book_id, "chapter_id": chapter_id, "scene_id": scene_id, "stage": stage}
        _as_sent(spec.task_name, **{k: (v, str) for k, v in ids.items()}, dispatch_id=(dispatch_id, str),
                 fencing_token=(fencing_token, int))  # fmt: skip
        # Another stage's job ran its generator on this stage's GPU worker; an unknown stage's, a KeyError.
        if stage != spec.name:
            raise InvalidCommand(f"{spec.task_name}: stage must be {spec.name!r}, got {show_value(stage)}")
        worker = delivery_holder(self.request.hostname or "unknown", os.getpid())

        def run(job_ports: Ports, job: Job, progress: Callable[[float], None], later: Later) -> dict[str, Any]:
            return run_job(job_ports, job, worker=worker, progress=progress, later=later)

        job = Job(book_id, chapter_id, scene_id, stage, dispatch_id, int(fencing_token))
        try:
            return chain.run_chain(self, ports(), spec.queue, job, run)
        except DeliveryNotStarted as err:  # nothing ran: the message back to the broker, not acked and gone
            raise Reject(str(err), requeue=True) from err


for _spec in settings.stages:
    _register_generate(_spec)
