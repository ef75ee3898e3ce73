"""Consumer presence: each worker advertises the queues it consumes, with a TTL.

A heartbeat thread writes `hostname -> expiry` into one sorted set per queue every
TTL/3. Queues added or cancelled at runtime (`add_consumer`/`cancel_consumer`) show
up at the next beat because the consumer's live queue list is read each time; a
clean stop removes the entries; a SIGKILLed worker's entries expire within one TTL.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps

from animastor_tasks.errors import StoreUnavailable

log = logging.getLogger("animastor.presence")


class PresenceStep(bootsteps.StartStopStep):
    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._advertised: set[str] = set()

    def start(self, parent: Any) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(parent,), name="animastor-presence", daemon=True)
        self._thread.start()

    def stop(self, parent: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._withdraw(parent)

    shutdown = stop

    def _loop(self, parent: Any) -> None:
        from animastor_tasks.worker import wiring

        ttl = wiring.current().settings.presence_ttl_seconds
        while True:
            try:
                queues = {q.name for q in (parent.task_consumer.queues if parent.task_consumer else [])}
                wiring.current().presence.heartbeat(parent.hostname, queues, ttl, gone=self._advertised - queues)
                self._advertised = queues
            except StoreUnavailable as err:
                log.warning("[PRESENCE] heartbeat failed: %s", err)
            except Exception:
                log.exception("[PRESENCE] heartbeat failed")
            if self._stop.wait(ttl / 3):
                return

    def _withdraw(self, parent: Any) -> None:
        if not self._advertised:
            return
        from animastor_tasks.worker import wiring

        try:
            wiring.current().presence.heartbeat(parent.hostname, (), 0, gone=self._advertised)
            self._advertised = set()
        except StoreUnavailable as err:
            log.warning("[PRESENCE] could not withdraw %s: %s", parent.hostname, err)
