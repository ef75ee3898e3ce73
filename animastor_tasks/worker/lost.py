"""A GPU job whose pool process died is let go at once by the worker's main process, which sees it die.

A pool process killed mid-job (the OOM killer, a CUDA fault, a segfault, Celery's hard time limit) leaves its
job's running marker and lease behind. Left alone, the marker makes the broker's redelivery of the message
(`reject_on_worker_lost`) a duplicate that does not run, and the lease keeps the pair and its lane slot for up
to `lease_ttl` (120 s by default) before the tick takes it over: a GPU idle while its job waits.

The main process knows which pool process died (`Request.worker_pid`), and each process leaves an entry
naming the job it runs (`liveness.delivery_holder`; a job kept to follow in the same task too, which has no
message of its own). So, before Celery requeues or acknowledges the message:

- the job the message names gives up its running marker and keeps its lease: the redelivery, at the head of
  the queue, runs it again at once;
- any other job (kept to follow, or a message Celery acknowledges, as after a hard time limit) gives up its
  lease as well, and the tick takes the pair over within one tick.

Both count the start as lost (`job_rules.lost_starts`), so a scene that kills every process running it still
fails after `ANIMASTOR_WORKER_LOST_LIMIT` starts.

A worker killed whole (SIGKILL after a deployment's grace period, a container restarted) that starts again
under the same node name lets go, before it runs anything, of the jobs its previous run still held: their
leases are dropped and the tick takes the pairs over, rather than the lane's slots waiting for those leases to
lapse. (Node names are unique, as Celery requires; a second live worker under the same name would have its
jobs fenced off.) One that never comes back is covered by its leases lapsing, as before.
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery.worker.request import Request

from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.adapters.redis.leases import LeaseStore
from animastor_tasks.config import Settings
from animastor_tasks.domain.keys import Keyspace
from animastor_tasks.domain.liveness import delivery_holder
from animastor_tasks.errors import StoreUnavailable

log = logging.getLogger("animastor.generate")

_PROCESS_GONE = (WorkerLostError, SystemExit, KeyboardInterrupt)  # how Celery reports a pool process's death


class GenerateRequest(Request):
    """The request class of the GPU tasks (`Task.Request`): its failure handlers run in the main process."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, _PROCESS_GONE) and self.worker_pid:
            let_go(self.hostname, self.worker_pid, redelivered=self.kwargs.get("dispatch_id"))
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft and self.worker_pid:  # the process is killed and the message acknowledged: nothing redelivers it
            let_go(self.hostname, self.worker_pid, redelivered=None)
        super().on_timeout(soft, timeout)


def let_go(worker: str, pid: int, redelivered: str | None) -> None:
    """Free what the dead process `pid` of `worker` held. Never raises: the lease's lapse still frees it."""
    from animastor_tasks.worker import wiring

    holder = delivery_holder(worker, pid)
    try:
        freed = LeaseStore(wiring.current().redis).abandon_delivery(holder, redelivered)
    except StoreUnavailable as err:
        log.warning("[GENERATE] pool process %s died; its job is left to its lease: %s", holder, err)
        return
    except Exception:
        log.exception("[GENERATE] pool process %s died; its job is left to its lease", holder)
        return
    if freed is None:
        return
    dispatch_id, dropped = freed
    then = "the tick takes its pair over" if dropped else "its redelivery runs it again"
    log.warning("[GENERATE] pool process %s died running dispatch %s; %s", holder, dispatch_id, then)


def let_go_of_previous_run(settings: Settings, node: str) -> None:
    """`worker_init`, in the main process before any pool process starts: free what the previous run of this
    node still held. On a connection of its own, closed again, so that none crosses the pool's fork."""
    conn = RedisConnection(settings.redis_url, Keyspace(settings.key_prefix))
    try:
        freed = LeaseStore(conn).abandon_node(node)
    except StoreUnavailable as err:
        log.warning("[WORKER] %s: what a previous run held is left to its leases: %s", node, err)
        return
    finally:
        conn.client.close()
    for dispatch_id, _ in freed:
        log.warning(
            "[WORKER] %s started again: dispatch %s of its previous run let go; the tick takes it over",
            node,
            dispatch_id,
        )
