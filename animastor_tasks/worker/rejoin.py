"""A worker that lost its broker rejoins within about a second of the network coming back, and takes no job it
cannot start.

Celery's consumer retries a lost broker connection with kombu's default back-off (2, 4, 6 ... up to 30 s
between tries), so a GPU worker cut off for 30 s came back 12-16 s after the heal, and one cut off for
longer up to 30 s after it. Here every try follows the last by at most `RECONNECT_INTERVAL_MAX`: a try
against an unreachable broker costs one connect timeout, nothing else, so trying often is cheap.

On AMQP, a job running when the connection was lost (a broker restart or failover, a missed heartbeat, a channel
closed by its consumer timeout) still holds its process, but its message was on the channel that died, so it no
longer counts against the new channel's prefetch. Celery reconnects with a prefetch of at least one, and gives
the rest back as the new channel's jobs are acked: a worker whose every process was busy took one more job it
could not start until its running job ended, while other workers of the queue sat idle (reconcile, counting the
queue's ready messages, took it for queued). Here the new channel's prefetch leaves out exactly the processes
such jobs hold; while they hold all of them the worker does not consume its task queues (it beats for them as
held, worker/presence.py), and each of those jobs that ends gives its process back at once (a hub tick in the
event loop's thread, where every channel operation happens). The Redis broker fetches only for a free process
(`worker_disable_prefetch`) and keeps Celery's own handling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from vine import promise

from animastor_tasks.worker import message_shape

RECONNECT_INTERVAL_MAX = 1.0

log = logging.getLogger("animastor.rejoin")


def _held_elsewhere(channel: Any) -> int:
    """Processes running a job whose message is still unacked on a channel other than `channel` (a lost one)."""
    return sum(
        1
        for request in tuple(worker_state.active_requests)
        if request.task.acks_late and not request.acknowledged and request.message.channel is not channel
    )


class HoldBackStep(bootsteps.StartStopStep):
    """After the task consumer is made, before the event loop starts consuming (`RejoiningConsumer.hold_back`)."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def start(self, parent: Any) -> None:
        parent.hold_back()


class RejoiningConsumer(Consumer):
    """Celery's consumer with a flat reconnect interval, a prefetch that counts the jobs of lost channels and a
    refusal of the messages it cannot unpack (`message_shape.guarded`) (selected by `worker_consumer`)."""

    class Blueprint(Consumer.Blueprint):
        default_steps = [*Consumer.Blueprint.default_steps, f"{__name__}:HoldBackStep"]

    held_back: frozenset[str] = frozenset()  # task queues not consumed meanwhile (read by worker/presence.py)
    _counted = 0  # processes held by jobs of lost channels that the prefetch now leaves out
    _following = False  # AMQP with a channel-wide prefetch, reconnected: `_counted` is kept up to date

    def create_task_handler(self, promise: Any = promise) -> Callable[[Any], None]:
        return message_shape.guarded(self, super().create_task_handler(promise))

    def ensure_connected(self, conn: Any) -> Any:
        ensure = conn.ensure_connection

        def ensure_quickly(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("interval_start", 0)
            kwargs.setdefault("interval_step", RECONNECT_INTERVAL_MAX)
            kwargs.setdefault("interval_max", RECONNECT_INTERVAL_MAX)
            return ensure(*args, **kwargs)

        conn.ensure_connection = ensure_quickly
        try:
            return super().ensure_connected(conn)
        finally:
            del conn.ensure_connection  # the instance attribute only: kombu's method shows through again

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        amqp = self.connection is not None and self.connection.transport.driver_type == "amqp"
        if self.hub is not None:
            self.hub.on_tick.discard(self._follow)
        super().on_connection_error_after_connected(exc)
        # Per-consumer QoS (quorum queues) never changes a running consumer's prefetch: Celery's handling stays.
        self._following = amqp and self.hub is not None and self.qos_global is not False
        if not self._following:
            return
        busy = _held_elsewhere(None)  # every running job's channel is lost now
        self._counted = busy
        self.initial_prefetch_count = self._prefetch_for(busy)
        self._maximum_prefetch_restored = True  # Celery's restoring, on the new channel's acks, stays off
        # Said at once, so the heartbeat during the outage and the reconnect says held (worker/presence.py).
        self.held_back = self._selected() if busy >= self.pool.num_processes else frozenset()

    def hold_back(self) -> None:
        """With every process still held by a job of a lost channel, leave the task queues out of the consumer
        before the event loop consumes them; `_follow` adds them back once a process is free."""
        if not self._following:
            return
        busy = _held_elsewhere(self.task_consumer.channel)
        if busy >= self.pool.num_processes:
            self.held_back = self._selected()
            self.task_consumer.queues = [q for q in self.task_consumer.queues if q.name not in self.held_back]
            log.info(
                "[WORKER] reconnected with every process (%d) running a job: not consuming %s until one ends",
                busy,
                ", ".join(sorted(self.held_back)),
            )
        else:
            self.held_back = frozenset()
        self._follow()
        if self._counted:
            self.hub.on_tick.add(self._follow)

    def _follow(self) -> None:
        """Give the new channel the processes that jobs of lost channels no longer hold (event loop thread)."""
        busy = _held_elsewhere(self.task_consumer.channel)
        if busy != self._counted:
            change = self._prefetch_for(busy) - self._prefetch_for(self._counted)
            self._counted = busy
            if change > 0:
                self.qos.increment_eventually(change)
            elif change < 0:
                self.qos.decrement_eventually(-change)
            self.qos.update()
        if self.held_back and busy < self.pool.num_processes:
            held = self.held_back
            for name in sorted(held & self._selected()):  # unless cancelled meanwhile (`cancel_consumer`)
                self.add_task_queue(name)
            self.held_back = frozenset()
            log.info("[WORKER] a process is free: consuming %s again", ", ".join(sorted(held)))
        if not busy:
            self.hub.on_tick.discard(self._follow)

    def _selected(self) -> frozenset[str]:
        """The task queues this worker consumes (`-Q`, with `add_consumer`/`cancel_consumer` since)."""
        return frozenset(self.app.amqp.queues.consume_from)

    def _prefetch_for(self, busy: int) -> int:
        # Never 0, which AMQP reads as no limit: with every process busy the queues are held back instead.
        return int(max(self.pool.num_processes - busy, 1) * self.prefetch_multiplier)
