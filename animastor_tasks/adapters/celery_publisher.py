"""The flows' `Publisher` on a Celery app: jobs to their stage queue, revokes, gate passes."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from billiard.exceptions import WorkerLostError
from celery import Celery
from kombu.exceptions import OperationalError

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.ports import Counters

log = logging.getLogger("animastor.dispatch")


class CeleryPublisher:
    def __init__(self, app: Celery, counters: Counters) -> None:
        self.app = app
        self.counters = counters
        self._events: Any = None

    def publish_job(self, task_name: str, queue: str, dispatch_id: str, kwargs: dict[str, Any]) -> None:
        # Celery would build this with its `saferepr`, the costliest step of a publish; a job's kwargs are a
        # few short strings and numbers, which plain `repr` shows the same.
        shown = repr(kwargs)
        with self.app.producer_or_acquire() as producer:
            self.app.send_task(
                task_name,
                kwargs=kwargs,
                queue=queue,
                task_id=dispatch_id,
                producer=producer,
                retry=True,
                retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
                argsrepr="()",
                kwargsrepr=shown,
                # None: no limits in the message. *Why:* Celery put this process's own limits for the task there,
                # and the GPU worker ran the job under them (the control host's, say), not its own.
                time_limit=None,
                soft_time_limit=None,
            )
            self._announce_sent(producer, task_name, queue, dispatch_id, shown)

    def _announce_sent(self, producer: Any, task_name: str, queue: str, dispatch_id: str, shown: str) -> None:
        """A `task-sent` event for a GPU job, so Flower shows it queued (PENDING) before a worker takes it.

        Celery sends this event for every task or for none (`task_send_sent_event`, off: control tasks
        are latency-bound); a GPU job waits for a GPU anyway, so it gets one here, published after the
        job itself so it never delays the job. Best-effort: an event lost costs only Flower's view.
        """
        try:
            if self._events is None:
                self._events = self.app.events.Dispatcher(enabled=False)  # publishes through our producer
            parent = self.app.current_worker_task
            parent_id = parent.request.id if parent is not None else None
            root_id = (parent.request.root_id or parent_id) if parent is not None else dispatch_id
            fields = {
                "uuid": dispatch_id,
                "root_id": root_id,
                "parent_id": parent_id,
                "name": task_name,
                "args": "()",
                "kwargs": shown,
                "retries": 0,
                "eta": None,
                "expires": None,
                "queue": queue,
                "exchange": queue,
                "routing_key": queue,
            }
            self._events.publish("task-sent", fields, producer, retry=False)
        except Exception as err:
            log.debug("[DISPATCH] task-sent event for %r not published: %s", dispatch_id, err)

    def revoke(self, dispatch_ids: Sequence[str]) -> None:
        try:
            self.app.control.revoke(list(dispatch_ids))
        except Exception as err:  # the start-of-job check is what guarantees safety; revoke only saves work
            self.counters.add({"revoke:failed": 1})
            log.warning("[DISPATCH] revoke broadcast failed: %s", err)

    def fail_lost(self, node: str, dispatch_ids: Sequence[str], why: str) -> None:
        fail_lost(self.app, node, dispatch_ids, why, events=bool(self.app.conf.worker_send_task_events))

    def enqueue_refill(
        self,
        book_id: str,
        lane: str | None = None,
        freed: str | None = None,
        slots: int | None = None,
        batch: str | None = None,
    ) -> None:
        # The optional kwargs only when set: a message without them is one every version of the task takes.
        optional = {"freed": freed, "slots": slots, "batch": batch}
        kwargs = {"book_id": book_id, "lane": lane} | {k: v for k, v in optional.items() if v is not None}
        with self._broker_errors():
            self.app.send_task("animastor.refill", kwargs=kwargs, queue=CONTROL_QUEUE)

    def enqueue_gates(self, book_ids: Sequence[str]) -> None:
        with self._broker_errors():
            self.app.send_task("animastor.gate_batch", kwargs={"book_ids": list(book_ids)}, queue=CONTROL_QUEUE)

    @contextmanager
    def _broker_errors(self) -> Iterator[None]:
        """A broker that cannot take a control message is `StoreUnavailable`, as every store at its edge. *Why:*
        kombu's own error went past every caller, which handles a store's: a tick's batch of passes ended at the
        first refill it could not send, the books after it taken off the due index and left to reconcile."""
        try:
            yield
        except (OperationalError, OSError) as err:
            raise StoreUnavailable("broker", str(self.app.conf.broker_url), str(err) or type(err).__name__) from err


def fail_lost(app: Celery, node: str, dispatch_ids: Sequence[str], why: str, *, events: bool) -> None:
    """Each job of `node` let go of: FAILURE (`WorkerLostError`, saying `why`) in the result store and, with `events`,
    a `task-failed` event under `node`'s name. *Why:* both kept the STARTED or PROGRESS its lost run left, for good,
    though the journal said the pair had run again. Best effort: only Flower's view and a stored result are at stake."""
    if not dispatch_ids:
        return
    lost = WorkerLostError(why)
    try:
        with app.events.default_dispatcher(hostname=node, enabled=events) as dispatcher:
            for dispatch_id in dispatch_ids:
                app.backend.mark_as_failure(dispatch_id, lost)
                dispatcher.send("task-failed", uuid=dispatch_id, exception=repr(lost), traceback="")
    except Exception as err:
        log.warning("[DISPATCH] %s: jobs let go not marked failed for Flower: %s: %s", node, type(err).__name__, err)
