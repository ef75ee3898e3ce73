"""The flows' `Publisher` on a Celery app: jobs to their stage queue, revokes, gate passes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery import Celery

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.ports import Counters

log = logging.getLogger("animastor.dispatch")


class CeleryPublisher:
    def __init__(self, app: Celery, counters: Counters) -> None:
        self.app = app
        self.counters = counters

    def publish_job(self, task_name: str, queue: str, dispatch_id: str, kwargs: dict[str, Any]) -> None:
        self.app.send_task(
            task_name,
            kwargs=kwargs,
            queue=queue,
            task_id=dispatch_id,
            retry=True,
            retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
        )

    def revoke(self, dispatch_ids: Sequence[str]) -> None:
        try:
            self.app.control.revoke(list(dispatch_ids))
        except Exception as err:  # the start-of-job check is what guarantees safety; revoke only saves work
            self.counters.add({"revoke:failed": 1})
            log.warning("[DISPATCH] revoke broadcast failed: %s", err)

    def enqueue_gate(self, book_id: str, lane: str | None = None) -> None:
        kwargs = {"book_id": book_id} if lane is None else {"book_id": book_id, "lane": lane}
        self.app.send_task("animastor.gate", kwargs=kwargs, queue=CONTROL_QUEUE)
