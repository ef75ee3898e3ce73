"""Leases of jobs still waiting in their queue, and the evidence that they still wait.

A job renews its lease only once it runs. So that a backlog longer than the lease TTL does
not look dead (and is not dispatched again, then thrown away at its first renewal), a
dispatch takes a *queued lease* that lives as long as the undelivered marker; the job's
start checks that it still holds it and shortens it to the stage's `lease_ttl`, which the
running job then renews. A lapsed lease therefore always means a started job stopped
renewing (its worker died or was cut off), and the tick takes such a pair over at once.

A queued lease must not outlive a message the broker lost: reconcile asks the broker
which undelivered jobs still wait. Two kinds of evidence say one does:

* the broker lists the waiting messages (Redis broker): the dispatch id is among them;
* the broker only counts them (AMQP: a passive declare gives the ready messages per queue).
  Each dispatch leaves an *undelivered marker* (`keys.Keyspace.queued`) that its first
  delivery removes, so the undelivered dispatches of a queue are the messages we put there
  and nobody took yet. A queue is first in, first out: when it holds N ready messages, the N
  most recently dispatched undelivered jobs are the ones still in it. If it holds at least as
  many as there are undelivered dispatches, all of them are waiting; the oldest ones beyond N
  were lost (a purged queue, a broker that lost non-durable messages, a message held by a
  worker cut off before it could start it): reconcile drops their lease and expires them.

Messages of superseded or revoked dispatches still count in N, so a lost message can hide
behind them, but only until the backlog drains: liveness comes late, never wrongly early,
and fencing keeps a second copy harmless either way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

#: How long an undelivered marker lives: the longest a job may wait in its queue and still be
#: taken for alive by the count; beyond it reconcile treats it as lost (a dispatch, fenced).
UNDELIVERED_MARKER_SECONDS = 24 * 3600

#: The share of its period a periodic pass (tick, reconcile) holds its singleton lock for: a second
#: beat's pass is skipped while the first runs, and finds the lock free next period if its holder died.
PERIODIC_LOCK_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class Dispatched:
    """The current dispatch of one `generating` pair, as reconcile sees it."""

    dispatch_id: str
    queue: str
    dispatched_at: float | None  # from its undelivered marker; None once delivered (or unknown)


#: The lease of a job waiting in its queue: as long as its undelivered marker, so the job still holds
#: it when a worker takes it, however long the backlog. A lost message gives its lease up through
#: reconcile (the broker's evidence), never by waiting.
QUEUED_LEASE_SECONDS = UNDELIVERED_MARKER_SECONDS


def queued_lease_ttl() -> int:
    """The lease a dispatch takes (and reconcile restores) for a job that has not started yet."""
    return QUEUED_LEASE_SECONDS


#: How long a worker process's entry saying which job it runs lives: a day, far longer than a job's hard time
#: limit; an entry left behind is harmless, since whatever it names is only ever removed while still held.
HOLDING_ENTRY_SECONDS = 24 * 3600
# How long a job let go of as its process died stays marked, its lease never taken back by that process: Celery kills
# a pool process a tenth of a second after its hard time limit lets the job go; an hour covers any slower death.
ABANDONED_MARK_SECONDS = 3600


def delivery_holder(worker: str, pid: int) -> str:
    """Who holds a running job: its worker's node name and the pool process's id, which both the process
    running it and the worker's main process, the one that sees it die, can name."""
    return f"{worker}#{pid}"


def holder_node(holder: str) -> str:
    """The worker node name a holder belongs to (the inverse of `delivery_holder` for its first part)."""
    return holder.rsplit("#", 1)[0]


#: How long a node's last heartbeat stays on record after it stopped: names of hosts long gone (every pod a
#: Deployment replaced) are forgotten after that, and their jobs' leases have lapsed many times over by then.
FORGET_SILENT_NODE_SECONDS = 24 * 3600


def silent_nodes(last_beats: Mapping[str, float], now: float, silent_seconds: float) -> set[str]:
    """The worker nodes whose last heartbeat (`last_beats`, by the Redis server's clock) is more than `silent_seconds`
    old: a lost host, one a deployment replaced under a new name, or one cut off from Redis that long. A node with
    no heartbeat on record is not among them: nothing says when, or whether, it stopped."""
    return {node for node, beat in last_beats.items() if now - beat > silent_seconds}


def lost_in_queue(undelivered: Collection[str], queued: Collection[str]) -> set[str]:
    """Dispatches never delivered that the broker no longer holds as waiting: their message is lost."""
    return set(undelivered) - set(queued)


def still_queued(
    dispatches: Sequence[Dispatched],
    queued_ids: Collection[str] | None,
    depths: Mapping[str, int] | None,
) -> set[str]:
    """The dispatch ids (lease alive or not) that are still waiting in their queue.

    `queued_ids`: the ids the broker lists as waiting (None where it cannot list them);
    `depths`: ready messages per queue (None where it cannot count them). A listing wins.
    """
    if queued_ids is not None:
        return {d.dispatch_id for d in dispatches if d.dispatch_id in queued_ids}
    if depths is None:
        return set()
    undelivered: dict[str, list[Dispatched]] = defaultdict(list)
    for d in dispatches:
        if d.dispatched_at is not None:
            undelivered[d.queue].append(d)
    in_queue: set[str] = set()
    for queue, waiting in undelivered.items():
        newest_first = sorted(waiting, key=lambda d: (d.dispatched_at or 0.0, d.dispatch_id), reverse=True)
        in_queue.update(d.dispatch_id for d in newest_first[: max(0, depths.get(queue, 0))])
    return in_queue
