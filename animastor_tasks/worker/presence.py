"""Consumer presence: each worker advertises the queues it consumes, with a TTL.

A heartbeat thread writes `hostname -> expiry` into one sorted set per queue every
TTL/3. Queues added or cancelled at runtime (`add_consumer`/`cancel_consumer`) show
up at the next beat because the consumer's live queue list is read each time; a
clean stop removes the entries; a SIGKILLed worker's entries expire within one TTL.
A consumer restarted because its broker connection was lost keeps its entries: the
worker consumes again once the broker is back (or once a process is free, worker/rejoin.py), and a
stage with no consumer is BLOCKED. A starting worker beats from the start of its blueprint, before its consumer
can (`StartingPresenceStep`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import bootsteps, signals
from celery.bootsteps import RUN
from celery.worker import state as worker_state

from animastor_tasks.domain.registry import CONTROL_QUEUE, limits_differ, limits_of
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import lanes

log = logging.getLogger("animastor.presence")


class StartingPresenceStep(bootsteps.StartStopStep):
    """A starting worker holds the queues it will consume (`holding` beats every TTL/3) from the start of its
    blueprint until its consumer's `PresenceStep` beats. *Why:* a stage's only worker killed whole (the OOM killer,
    a crash) and restarted under its name (systemd, a container's restart policy) first beat from its consumer,
    after its pool, its broker connection and mingle: the killed run's heartbeat lapsed meanwhile and the tick
    BLOCKED the stage's commands for good. Started after the start checks (`app.refuse_*`, exit 2 before any
    beat) and after `lost.let_go_of_previous_run` (which watches the name's heartbeat). A worker that stops
    before its consumer beats withdraws nothing: its entries expire within a TTL, as a killed one's; so do those of
    one whose consumer has not started `silent_worker_seconds` after its start (a broker it cannot reach)."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._lock = threading.Lock()  # a beat and the consumer's hand-over never interleave
        self._done = threading.Event()
        self._advertised: set[str] = set()
        parent.starting_presence = self

    def start(self, parent: Any) -> None:
        queues = set(parent.app.amqp.queues.consume_from or ())
        if queues:
            thread = threading.Thread(
                target=self._loop, args=(parent.hostname, queues), name="animastor-presence-start", daemon=True
            )
            thread.start()

    def stop(self, parent: Any) -> None:
        self._done.set()

    terminate = stop

    def hand_over(self) -> set[str]:
        """The consumer's heartbeat takes over: no beat of this step follows. Returns the queues it advertised,
        once (the consumer's heartbeat withdraws those it does not consume)."""
        with self._lock:
            self._done.set()
            advertised, self._advertised = self._advertised, set()
        return advertised

    def _loop(self, hostname: str, queues: set[str]) -> None:
        from animastor_tasks.worker import wiring

        settings = wiring.current().settings
        ttl, until = settings.presence_ttl_seconds, time.monotonic() + settings.silent_worker_seconds
        while True:
            with self._lock:
                if self._done.is_set():
                    return
                if time.monotonic() >= until:  # *why:* a broker it never reaches kept its stage from a BLOCK for ever
                    log.warning(
                        "[PRESENCE] %s: no consumer %.0fs after its start (its broker?): %s held no longer",
                        hostname,
                        settings.silent_worker_seconds,
                        ", ".join(sorted(queues)),
                    )
                    return
                self._advertised = set(queues)  # before: a beat cut short may have written them
                try:
                    wiring.current().presence.heartbeat(hostname, queues, ttl, holding=True)
                except StoreUnavailable as err:
                    log.warning("[PRESENCE] heartbeat while starting failed: %s", err)
                except Exception:
                    log.exception("[PRESENCE] heartbeat while starting failed")
            if self._done.wait(ttl / 3):
                return


class PresenceStep(bootsteps.StartStopStep):
    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._advertised: set[str] = set()
        self._draining = threading.Event()
        self._reconnecting = threading.Event()
        self._wake = threading.Event()  # beat now, not at the end of the wait: the worker stopped consuming
        self._disagreed: list[str] = []  # how its stage limits differed from the control workers' when last told

    def start(self, parent: Any) -> None:
        self._draining.clear()
        self._reconnecting.clear()
        if self._thread is not None and self._thread.is_alive():
            self._wake.set()
            return  # the consumer restarted while a job was still draining: the heartbeat never stopped
        self._stop.clear()
        starting = getattr(parent.controller, "starting_presence", None)
        if starting is not None:  # what the worker held while it started: its first beat withdraws the rest
            self._advertised |= starting.hand_over()
        self._thread = threading.Thread(target=self._loop, args=(parent,), name="animastor-presence", daemon=True)
        self._thread.start()

    def stop(self, parent: Any) -> None:
        # A lost broker connection restarts the consumer (`stop`, then `start` once connected) while the blueprint
        # still runs: withdrawing then made an idle worker look gone for the whole outage, and the gate BLOCKED its
        # stage's commands. It keeps beating the queues it had until it consumes again.
        if parent.blueprint.state == RUN:
            self._reconnecting.set()
            self._wake.set()
            return
        # Warm shutdown stops the consumer before the pool has finished its jobs. Withdrawing now would tell
        # the gate that nobody consumes the stage: it would BLOCK the command and release the pair, and the
        # job still running would be fenced out at commit. So a worker with jobs keeps advertising until
        # they are done (or the worker has shut down), then withdraws.
        if _jobs_in_hand():
            if not self._draining.is_set():  # stop() and shutdown() both come here
                self._draining.set()
                self._wake.set()
                signals.worker_shutdown.connect(lambda **_: self._finish(parent), weak=False)
            return
        self._finish(parent)

    shutdown = stop

    def _finish(self, parent: Any) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._withdraw(parent)

    def _loop(self, parent: Any) -> None:
        from animastor_tasks.worker import wiring

        ttl = wiring.current().settings.presence_ttl_seconds
        while True:
            if self._draining.is_set() and not _jobs_in_hand():
                self._withdraw(parent)
                return
            try:
                # No consumer now: it keeps what it had, and says it holds them (the broker counts it out, its
                # heartbeat stands: presence.PresenceStore.counts). So for the queues it leaves unconsumed while
                # every process runs a job taken before a reconnect (`held_back`, worker/rejoin.py).
                held = set(getattr(parent, "held_back", ()))
                lost = self._draining.is_set() or self._reconnecting.is_set()
                holding = lost or bool(held)
                if lost:
                    queues = set(self._advertised)
                else:
                    queues = held | {q.name for q in (parent.task_consumer.queues if parent.task_consumer else [])}
                arrived = wiring.current().presence.heartbeat(
                    parent.hostname, queues, ttl, gone=self._advertised - queues, holding=holding
                )
                self._advertised = queues
                self._compare_limits(parent.hostname, queues)
            except StoreUnavailable as err:
                log.warning("[PRESENCE] heartbeat failed: %s", err)
            except Exception:
                log.exception("[PRESENCE] heartbeat failed")
            else:
                _hand_on_awaited(arrived)
            self._wake.wait(ttl / 3)
            self._wake.clear()
            if self._stop.is_set():
                return

    def _compare_limits(self, hostname: str, queues: set[str]) -> None:
        """A control worker publishes its stage limits; any other worker says once when its own differ. *Why:* each
        process claims against its own table: a GPU worker still at the old `lane_limit` after GPUs were added
        refilled its freed slot only below it, and the new slots idled until the tick (the lane 71% busy with 100
        pairs waiting), with no word of it anywhere."""
        from animastor_tasks.worker import wiring

        current = wiring.current()
        mine = limits_of(current.settings.registry)
        if CONTROL_QUEUE in queues:
            current.presence.publish_limits(mine)
            return
        theirs = current.presence.published_limits()
        differ = [] if theirs is None else limits_differ(mine, theirs)
        if differ and differ != self._disagreed:
            log.warning(
                "[PRESENCE] %s: its ANIMASTOR_STAGES disagrees with the control worker's (here/there: %s); each process"
                " claims against its own table's limits: restart every process with the same table",
                hostname,
                "; ".join(differ),
            )
        self._disagreed = differ

    def _withdraw(self, parent: Any) -> None:
        if not self._advertised:
            return
        from animastor_tasks.worker import wiring

        try:
            wiring.current().presence.heartbeat(parent.hostname, (), 0, gone=self._advertised)
            self._advertised = set()
        except StoreUnavailable as err:
            log.warning("[PRESENCE] could not withdraw %s: %s", parent.hostname, err)


def _hand_on_awaited(queues: set[str]) -> None:
    """Queues passes awaited a worker on, consumed now by this one: their lanes go to the books waiting, in a
    thread of its own. *Why not in the heartbeat's:* a Postgres or broker stall there delayed the next beat past
    its TTL, and the worker read as gone. Best effort: missed, the books are due again within
    `silent_worker_seconds` (`lanes.await_worker`)."""
    if queues:
        threading.Thread(target=_hand_on, args=(queues,), name="animastor-hand-on", daemon=True).start()


def _hand_on(queues: set[str]) -> None:
    from animastor_tasks.worker import wiring

    try:
        lanes.consumers_arrived(wiring.current().ports, queues)
    except Exception:
        log.exception("[PRESENCE] the lanes of %s not handed on", sorted(queues))


def _jobs_in_hand() -> bool:
    """Jobs running, or handed to the pool and not yet reported started (`reserved`). *Why the second:* a SIGTERM
    handled in between withdrew the worker at once, and its job ran unadvertised: a stage whose only worker it was
    could be BLOCKED under it, its GPU work thrown away."""
    return bool(worker_state.active_requests or worker_state.reserved_requests)
