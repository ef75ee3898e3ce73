"""A GPU job whose pool process died is let go at once by the worker's main process, which sees it die.

A pool process killed mid-job (the OOM killer, a CUDA fault, a segfault, Celery's hard time limit) leaves its
job's running marker and lease behind. Left alone, the marker makes the broker's redelivery of the message
(`reject_on_worker_lost`) a duplicate that does not run, and the lease keeps the pair and its lane slot for up
to `lease_ttl` (120 s by default) before the tick takes it over: a GPU idle while its job waits.

The main process knows which pool process died (`Request.worker_pid`), and each process leaves an entry
naming the job it runs (`liveness.delivery_holder`; a job kept to follow in the same task too, which has no
message of its own). So, as Celery reports the death (before it requeues the message):

- the job the message names gives up its running marker and keeps its lease: its redelivery runs it, at once
  where nothing waits in the queue before it (on a Redis broker the message goes back behind any backlog; one
  longer than the lease's TTL sees the tick take the pair over first, and the message then finds it gone);
- any other job (kept to follow, or a message Celery acknowledges, as after a hard time limit) gives up its
  lease as well, and the tick takes the pair over within one tick.

Both count the start as lost (`job_rules.lost_starts`), so a scene that kills every process running it still
fails after `ANIMASTOR_WORKER_LOST_LIMIT` starts.

A worker killed whole (SIGKILL after a deployment's grace period, a container restarted) that starts again
under the same node name lets go, before it runs anything, of the jobs its previous run still held: their
leases are dropped and the tick takes the pairs over, rather than the lane's slots waiting for those leases to
lapse. A heartbeat of the name still live is watched for one beat first: a name that beats again is another
live worker's, whose jobs are left alone. One that never comes back is let go by the tick (flow/takeover.py).

A worker told to shut down (SIGTERM: a rollout, before it kills; SIGQUIT: a cold shutdown, which kills at once)
notes the starts of the jobs it runs as ended by the operator should they never end (`note_shutdown`): the next
start of each does not count a lost one. A scene chased from worker to worker by a rolling restart failed
`worker_lost` otherwise, as one that kills every process. The note runs before Celery's own handler of the signal
(`first_on_shutdown_signals`): a cold shutdown kills the jobs there, before it tells anyone it shuts down. A
remote shutdown (Flower's Shut Down) sends no signal: the note runs before Celery's control command
(`first_on_remote_shutdown`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import Terminated, WorkerLostError
from celery import platforms
from celery.worker import control
from celery.worker.request import Request

from animastor_tasks.adapters.celery_publisher import fail_lost
from animastor_tasks.adapters.postgres import jobs
from animastor_tasks.adapters.redis import counters
from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.adapters.redis.leases import LeaseStore
from animastor_tasks.adapters.redis.presence import PresenceStore
from animastor_tasks.config import Settings
from animastor_tasks.domain.keys import Keyspace
from animastor_tasks.domain.liveness import delivery_holder
from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.errors import StoreUnavailable

log = logging.getLogger("animastor.generate")

# How Celery reports a pool process's death; `Terminated`: killed by Celery itself (`revoke --terminate`, Flower's
# Terminate, a cold shutdown). *Why that too:* after a SIGKILL there, the job's lease and running marker stood and its
# pair and slot waited out the lease (120 s).
_PROCESS_GONE = (WorkerLostError, SystemExit, KeyboardInterrupt, Terminated)


class GenerateRequest(Request):
    """The request class of the GPU tasks (`Task.Request`): its failure handlers run in the main process."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, _PROCESS_GONE) and self._in_pool_process():
            # A job revoked as it was terminated has its message acknowledged: nothing redelivers it.
            redelivered = None if self._already_revoked else self.kwargs.get("dispatch_id")
            let_go(self.hostname, self.worker_pid, redelivered=redelivered, message=self.id, app=self.task.app)
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft and self._in_pool_process():  # the process is being killed; its message is acknowledged
            let_go(self.hostname, self.worker_pid, redelivered=None, message=self.id, app=self.task.app)
        super().on_timeout(soft, timeout)

    def _in_pool_process(self) -> bool:
        """The job ran in a pool process of its own (not in this one: a solo or threads pool)."""
        return bool(self.worker_pid) and self.worker_pid != os.getpid()


def _connection(settings: Settings) -> RedisConnection:
    """A short-lived connection of the main process's own: none is shared with the threads of the worker's
    wiring, none crosses a pool fork, and an unreachable Redis holds the worker's event loop one second."""
    return RedisConnection(settings.redis_url, Keyspace(settings.key_prefix), socket_timeout=1.0)


def let_go(worker: str, pid: int, redelivered: str | None, *, message: str | None = None, app: Any = None) -> None:
    """Free what the dead process `pid` of `worker` held. Never raises: the lease's lapse still frees it. A job let go
    that is not the task `message` Celery reports (one kept to follow in it, worker/chain.py) is failed in `app`'s
    result store and in Flower (`fail_lost`): Celery ends only the message's task, and the kept job's stayed
    PROGRESS for good."""
    from animastor_tasks.worker.app import settings

    holder = delivery_holder(worker, pid)
    conn = _connection(settings)
    try:
        freed = LeaseStore(conn).abandon_delivery(holder, redelivered)
        _count(conn, [freed] if freed else [])
    except StoreUnavailable as err:
        log.warning("[GENERATE] pool process %s died; its job is left to its lease: %s", holder, err)
        return
    except Exception:
        log.exception("[GENERATE] pool process %s died; its job is left to its lease", holder)
        return
    finally:
        conn.close()
    if freed is None:
        return
    dispatch_id, _, dropped = freed
    then = "the tick takes its pair over" if dropped else "its redelivery runs it again"
    log.warning("[GENERATE] pool process %s died running dispatch %s; %s", holder, dispatch_id, then)
    if app is not None and dropped and dispatch_id != message:
        why = f"{holder} died running it, kept to follow in task {message}; the tick took its pair over"
        fail_lost(app, worker, [dispatch_id], why, events=bool(app.conf.worker_send_task_events))


def let_go_of_previous_run(settings: Settings, node: str, app: Any = None, *, events: bool = False) -> None:
    """`celeryd_after_setup`, in the main process before any pool process starts: free what the previous run of this
    node still held. A heartbeat of the name still live (a run killed moments ago) is watched for one beat
    first: one that beats again is another live worker under the same name, whose jobs are left alone. `app`: the
    jobs let go are failed in its result store, and in Flower with `events` (`celery_publisher.fail_lost`)."""
    conn = _connection(settings)
    try:
        last = _last_beat(conn, settings, node)
        if last is not None:
            time.sleep(settings.presence_ttl_seconds / 3 + 0.5)  # a live worker beats every TTL/3
            again = _last_beat(conn, settings, node)
            if again is not None and again > last:
                log.warning(
                    "[WORKER] another worker runs as %s: its jobs are left alone (give each its own name)", node
                )
                return
        freed = LeaseStore(conn).abandon_node(node)
        _count(conn, freed)
    except StoreUnavailable as err:
        log.warning("[WORKER] %s: what a previous run held is left to its leases: %s", node, err)
        return
    finally:
        conn.close()
    for dispatch_id, _, _ in freed:
        log.warning(
            "[WORKER] %s started again: dispatch %s of its previous run let go; the tick takes it over",
            node,
            dispatch_id,
        )
    if app is not None:
        why = f"{node} was killed running it; started again, it let the job go and another ran the pair"
        fail_lost(app, node, [dispatch_id for dispatch_id, _, _ in freed], why, events=events)


def note_shutdown(settings: Settings, node: str) -> None:
    """Told to shut down, in the main process before Celery acts on it (`first_on_shutdown_signals`): the open starts
    of the jobs `node`'s processes run are noted as told to stop (a drained job ends its start as usual; one killed
    when the grace runs out, or by a cold shutdown, is not worker-lost).
    Bounded (a second for Redis, two for Postgres) and never raises: unnoted, a kill counts as before."""
    conn = _connection(settings)
    try:
        noted = jobs.note_shutdown(settings.database_url, LeaseStore(conn).node_jobs(node))
    except Exception as err:  # a store down at shutdown: the worker must still stop
        log.warning("[WORKER] %s shutting down: its running jobs' starts not noted: %s", node, err)
        return
    finally:
        conn.close()
    if noted:
        log.info(
            "[WORKER] %s shutting down with %d running job(s): a job this shutdown kills (a cold shutdown, or a warm"
            " one whose grace period runs out) is not counted as a lost worker",
            node,
            noted,
        )


SHUTDOWN_SIGNALS = ("SIGTERM", "SIGQUIT", "SIGINT")  # warm, cold, and Ctrl-C (warm, then cold once again)


def first_on_shutdown_signals(hook: Callable[[], None]) -> None:
    """`worker_ready`, in the main process, once Celery has installed its signal handlers: `hook` runs before
    Celery's handler of each shutdown signal. *Why:* a cold shutdown (SIGQUIT, `REMAP_SIGTERM=SIGQUIT`) kills
    the running jobs in that handler and sends `worker_shutting_down` only afterwards, so a note made there came
    too late and each killed job's next start counted a lost one. Handlers not Celery's worker's (a worker run
    in a test's thread installs none) are left alone; the ones Celery installs later (a cold shutdown's second
    signal) follow a signal whose hook has run."""
    main = os.getpid()
    for name in SHUTDOWN_SIGNALS:
        handler = platforms.signals[name]
        if callable(handler) and getattr(handler, "__module__", "") == "celery.apps.worker":
            platforms.signals[name] = _hook_first(hook, handler, main)


def first_on_remote_shutdown(hook: Callable[[str], None]) -> None:
    """The `shutdown` remote control command (Flower's Shut Down, `celery control shutdown`) runs `hook(node)` before
    Celery's own. *Why:* Celery's raises `WorkerShutdown` from the control command: a warm shutdown with no signal
    and no `worker_shutting_down`, so a job ending then kept its slot's next job and ran it (the drain a whole job
    longer) and the running starts went unnoted. Celery offers no hook for it; a command of the same name
    replaces its own (`control_command`), which this one calls."""
    celerys = control.Panel.data["shutdown"]

    @control.control_command(name="shutdown")
    def shutdown(state: Any, **kwargs: Any) -> Any:
        """Shutdown worker(s)."""
        _run_hook(hook, state.hostname)
        return celerys(state, **kwargs)


def _run_hook(hook: Callable[..., None], *args: Any) -> None:
    """The shutdown goes on whatever the hook did."""
    try:
        hook(*args)
    except Exception:
        log.exception("[WORKER] shutdown hook failed")


def _hook_first(hook: Callable[[], None], handler: Callable[..., Any], main: int) -> Callable[..., None]:
    """`handler`, after `hook` in the process `main` (a pool child inherits a handler it does not reset). A signal
    that arrives while the hook runs goes straight to `handler`, in place of the one the hook delays: Celery
    handles each signal once, and an operator who signals again does not wait for a store."""
    state = {"hooking": False, "handled": False}

    def handle(*args: Any) -> None:
        if os.getpid() != main:
            handler(*args)
            return
        if state["hooking"]:
            state["handled"] = True
            handler(*args)
            return
        state["hooking"], state["handled"] = True, False
        try:
            _run_hook(hook)
        finally:
            state["hooking"] = False
        if not state["handled"]:
            handler(*args)

    return handle


def _count(conn: RedisConnection, freed: list[tuple[str, str, bool]]) -> None:
    """`job:process_lost:<stage>` for the exporter."""
    if freed:
        counters.add_now(conn, Counter(f"job:process_lost:{stage}" for _, stage, _ in freed))


def _last_beat(conn: RedisConnection, settings: Settings, node: str) -> float | None:
    """When the live heartbeat of `node` expires (the latest over the queues it advertises), None if none is live."""
    live = PresenceStore(conn).live_consumers([CONTROL_QUEUE, *settings.registry.queues()])
    return max((beats[node] for beats in live.values() if node in beats), default=None)
