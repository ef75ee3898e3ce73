"""What Flower sees of the jobs a process runs itself (`chain.py`): their task events, under the worker's name, and
their progress; Celery announces only the task the broker delivered."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from queue import SimpleQueue
from typing import Any

from celery import Task

from animastor_tasks.flow.job import Job

log = logging.getLogger("animastor.worker")
PROGRESS_EVERY = 0.5  # seconds between a job's progress reports to Flower


class Events:
    on = False  # the worker sends task events (`-E`); set in the worker before its children fork


def remember_task_events(sender: Any = None, **_: Any) -> None:
    """`worker_init`: whether this worker announces its tasks, so kept jobs are announced alike."""
    Events.on = bool(getattr(sender, "task_events", False))


def progress_reporter(task: Task, job: Job) -> Callable[[float], None]:
    """Progress for Flower under the job's own id: its result's PROGRESS state and a `task-progress`
    event, at most every `PROGRESS_EVERY` seconds from the job's start. A job done sooner reports none: its
    result follows at once, and a report of 100% was a result write and an event more per job (a tenth of
    a worker's CPU per job of near-instant work). Sent by the process's progress thread (`Sender`), never by
    the generator's: a report due while the one before is still on its way is left out."""
    last = [time.monotonic()]
    sending = threading.Event()
    failed: list[str] = []

    def send(hostname: str, meta: dict[str, Any]) -> None:
        try:
            task.update_state(task_id=job.dispatch_id, state="PROGRESS", meta=meta)
            send_event(task, "task-progress", hostname=hostname, uuid=job.dispatch_id, **meta)
        except Exception as err:  # an event or a state lost costs only Flower's view; said once a job
            if not failed:
                failed.append(repr(err))
                log.warning("[GENERATE] %s progress not reported: %s: %s", job.describe(), type(err).__name__, err)
        finally:
            sending.clear()

    def report(fraction: float) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY and not sending.is_set():
            last[0] = now
            meta: dict[str, Any] = {
                "book_id": job.book_id,
                "chapter_id": job.chapter_id,
                "scene_id": job.scene_id,
                "stage": job.stage,
                "percent": round(fraction * 100, 1),
            }
            sending.set()
            Sender.send(partial(send, worker_name(task), meta))  # the name read here: a request is per thread

    return report


class Sender:
    """The process's one thread sending progress reports, in turn. *Why:* sent from the generator's thread, each
    report waited on a broker or result store out of reach (3 s each for a GPU host cut off from the broker), and a
    job of 12 s with 40 reports took 49 s; its GPU work stood still, though progress is for Flower alone."""

    pid = -1
    queue: SimpleQueue[Callable[[], None]] = SimpleQueue()

    @classmethod
    def send(cls, step: Callable[[], None]) -> None:
        if cls.pid != os.getpid():  # a forked pool child has no thread of its parent's
            cls.pid, cls.queue = os.getpid(), SimpleQueue()
            threading.Thread(target=cls._run, args=(cls.queue,), name="progress", daemon=True).start()
        cls.queue.put(step)

    @staticmethod
    def _run(steps: SimpleQueue[Callable[[], None]]) -> None:
        while True:
            steps.get()()


def announce(task: Task, kind: str, dispatch_id: str, **fields: Any) -> None:
    if not Events.on:
        return
    try:
        send_event(task, kind, uuid=dispatch_id, **fields)
    except Exception as err:  # an event lost costs only Flower's view
        log.debug("[GENERATE] %s event for %s not sent: %s", kind, dispatch_id, err)


_dispatchers: dict[str, Any] = {}  # this process's event dispatcher per worker hostname


def worker_name(task: Task) -> str:
    return task.request.hostname or "unknown"


def send_event(task: Task, kind: str, *, hostname: str | None = None, **fields: Any) -> None:
    """An event under the worker's name (`hostname`, else the running request's), through a pooled producer
    (as the publisher sends `task-sent`): `default_dispatcher` opens a channel per event, and on Redis a
    channel is a connection of its own, so every progress report cost a connect and a close."""
    hostname = hostname or worker_name(task)
    dispatcher = _dispatchers.get(hostname)
    if dispatcher is None:
        dispatcher = _dispatchers.setdefault(hostname, task.app.events.Dispatcher(hostname=hostname, enabled=False))
    with task.app.producer_or_acquire() as producer:
        dispatcher.publish(kind, fields, producer, retry=False)
