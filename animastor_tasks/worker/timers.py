"""Cancelled timers dropped from a prefork worker's event loop once a minute.

*Why:* the prefork pool sets each job's soft time limit as a timer of the worker's event loop, in the main
process. A job that ends cancels its timer, but kombu's timer only marks it and keeps it until its due time:
a GPU worker held one per job of the last `ANIMASTOR_JOB_SOFT_TIME_LIMIT` (30 minutes by default), about
0.55 kB each, and its main process grew 0.59 kB a job until the first of them fell due (13 MB over 22,000
near-instant jobs; a bare Celery worker with the same limits grew the same). asyncio drops its cancelled
timers the same way.
"""

from __future__ import annotations

import heapq
from typing import Any

from celery import bootsteps

DROP_EVERY_SECONDS = 60.0


def drop_cancelled(timer: Any) -> int:
    """Remove the cancelled entries of a kombu `Timer`; how many went. In place: the timer's iterator, which the
    event loop holds, keeps the list itself. Runs on the loop's own thread (a timer of it), so nothing else
    touches the list meanwhile."""
    queue: list[Any] = timer._queue  # kombu's heap of `scheduled(eta, priority, entry)`
    kept = [item for item in queue if not item.entry.canceled]
    dropped = len(queue) - len(kept)
    if dropped:
        queue[:] = kept
        heapq.heapify(queue)
    return dropped


class DropCancelledTimersStep(bootsteps.StartStopStep):
    """Worker step: with an event loop (the prefork pool), `drop_cancelled` every `DROP_EVERY_SECONDS`. The solo
    and thread pools have none, and set no time-limit timers in it."""

    requires = {"celery.worker.components:Hub"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.every: Any = None

    def start(self, parent: Any) -> None:
        hub = getattr(parent, "hub", None)
        if hub is not None:
            self.every = hub.call_repeatedly(DROP_EVERY_SECONDS, drop_cancelled, hub.timer)

    def stop(self, parent: Any) -> None:
        if self.every is not None:
            self.every.cancel()
            self.every = None
