"""Leases (one per dispatched pair, renewed by its job) and delivery markers (one per running job)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.domain.liveness import (
    ABANDONED_MARK_SECONDS,
    HOLDING_ENTRY_SECONDS,
    UNDELIVERED_MARKER_SECONDS,
    holder_node,
)
from animastor_tasks.domain.targets import stop_marker
from animastor_tasks.domain.types import BookPair


class LeaseStore:
    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn

    def take_leases(self, leases: Sequence[tuple[BookPair, str, int, dict[str, Any]]]) -> None:
        """Write lease + metadata for each (pair, dispatch id, ttl, metadata) in one round trip.

        A dispatch's claim (it comes with metadata) also leaves the dispatch's undelivered marker,
        removed by its first delivery: the evidence that it still waits in its queue. The metadata
        is read when the job starts (its queue wait), so it lives as long as the marker.
        """
        if not leases:
            return
        with self.conn.writes() as pipe:
            for pair, dispatch_id, ttl, meta in leases:
                pipe.set(self.conn.keys.lease(*pair), dispatch_id, ex=ttl)
                if meta:
                    meta_key = self.conn.keys.dispatch(dispatch_id)
                    pipe.hset(meta_key, mapping={k: str(v) for k, v in meta.items()})
                    pipe.expire(meta_key, max(ttl * 4, UNDELIVERED_MARKER_SECONDS))
                    at = meta.get("dispatched_at", 0)
                    pipe.set(self.conn.keys.queued(dispatch_id), str(at), ex=UNDELIVERED_MARKER_SECONDS)

    def restore_leases(self, leases: Sequence[tuple[BookPair, str, int, float]]) -> set[str]:
        """For each (pair, dispatch id, the pair's token, ttl) of a job still queued: take the lease if nobody holds
        it, extend it if this dispatch does, leave it alone if another one does (a newer dispatch of the pair) or
        the job was delivered meanwhile (`lua/restore_lease.lua`). The dispatches whose token is not the pair's any
        more (superseded while queued), which get none. One round trip."""
        if not leases:
            return set()
        keys = self.conn.keys
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for pair, dispatch_id, token, ttl in leases:
                self.conn.restore_script(
                    keys=[keys.lease(*pair), keys.running(dispatch_id), keys.dispatch(dispatch_id)],
                    args=[dispatch_id, int(ttl * 1000), token],
                    client=pipe,
                )
            answers = pipe.execute()
        return {dispatch_id for (_, dispatch_id, _, _), answer in zip(leases, answers, strict=True) if answer == -1}

    def _values(self, keys: list[str]) -> list[Any]:
        """The values of `keys`, None where one is missing: one round trip, none for no keys."""
        return list(self.conn.run(lambda: self.conn.client.mget(keys))) if keys else []

    def watch(self, pair: BookPair, book: str) -> tuple[str | None, bool]:
        def read() -> list[Any]:
            pipe = self.conn.client.pipeline(transaction=False)
            pipe.get(self.conn.keys.lease(*pair))
            pipe.exists(self.conn.keys.cancel_flag(book))
            return list(pipe.execute())

        holder, flagged = self.conn.run(read)
        return None if holder is None else str(holder), bool(flagged)

    def lease_holders(self, pairs: Sequence[BookPair]) -> list[str | None]:
        return [None if h is None else str(h) for h in self._values([self.conn.keys.lease(*p) for p in pairs])]

    def lease_seconds_left(self, pairs: Sequence[BookPair]) -> list[float | None]:
        """Per pair, the seconds its lease has left, None where it has none; one round trip."""
        if not pairs:
            return []
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for pair in pairs:
                pipe.pttl(self.conn.keys.lease(*pair))
            return [None if ms < 0 else ms / 1000 for ms in pipe.execute()]

    def undelivered(self, dispatch_ids: Sequence[str]) -> list[float | None]:
        """Per dispatch id, when it was dispatched if no delivery has taken it yet, else None."""
        return [None if m is None else float(m) for m in self._values([self.conn.keys.queued(d) for d in dispatch_ids])]

    def renew_lease(self, pair: BookPair, dispatch_id: str, ttl: float) -> bool:
        return bool(
            self.conn.run(
                lambda: self.conn.renew_script(keys=[self.conn.keys.lease(*pair)], args=[dispatch_id, int(ttl * 1000)])
            )
        )

    def release_lease(self, pair: BookPair, dispatch_id: str) -> None:
        self.release_leases([(pair, dispatch_id)])

    def release_leases(self, leases: Sequence[tuple[BookPair, str]]) -> None:
        """Compare-and-delete of each (pair, dispatch id): only while that dispatch holds the lease, so a newer
        claim of the pair keeps its own. In one round trip, or as writes of the open batch, if any: sent as the
        script's text (EVAL), since a pipeline asks first whether a script by hash is loaded."""
        with self.conn.writes() as pipe:
            for pair, dispatch_id in leases:
                pipe.eval(self.conn.release_lua, 1, self.conn.keys.lease(*pair), dispatch_id)

    def supersede(self, jobs: Sequence[tuple[BookPair, str, int]], remembered: int) -> int:
        """Dispatches a forced regenerate fenced off, each (pair, dispatch id, its stage's lease TTL): a running one
        told to stop through its lease, a queued one withdrawn (`lua/supersede.lua`), each only while it holds its
        pair's lease, and remembered as superseded for `remembered` seconds (`superseded`). A queued delivery that
        comes all the same finds no lease of its own and does not start. How many were running; one round trip."""
        if not jobs:
            return 0
        keys = self.conn.keys
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for pair, dispatch_id, ttl in jobs:
                self.conn.supersede_script(
                    keys=[
                        keys.lease(*pair),
                        keys.running(dispatch_id),
                        keys.queued(dispatch_id),
                        keys.superseded(dispatch_id),
                    ],
                    args=[dispatch_id, stop_marker(dispatch_id), ttl * 1000, remembered * 1000],
                    client=pipe,
                )
            return sum(1 for answer in pipe.execute() if answer == 1)

    def superseded(self, dispatch_ids: Sequence[str]) -> list[bool]:
        """Per dispatch id, whether a forced regenerate fenced it off (`supersede`); one round trip."""
        return [v is not None for v in self._values([self.conn.keys.superseded(d) for d in dispatch_ids])]

    def start_delivery(
        self, pair: BookPair, dispatch_id: str, worker: str, ttl: int
    ) -> tuple[bool, bool, bool, float | None]:
        """(the dispatch still held the pair's lease, now the running job's for `ttl`; this delivery owns the
        dispatch; the book is cancelled; when the dispatch was published, None if unknown), in one atomic round
        trip (`lua/start_delivery.lua`). `worker`: the holder (`liveness.delivery_holder`), whose entry then
        names this job until the next one it runs.

        A second delivery of a dispatch that is still running (broker redelivery after a
        visibility timeout) finds the running marker and does not run again. Any delivery ends the
        dispatch's undelivered marker: the job has left its queue.
        """
        keys = self.conn.keys
        lease, running, queued = keys.lease(*pair), keys.running(dispatch_id), keys.queued(dispatch_id)
        held, owned, cancelled, published = self.conn.run(
            lambda: self.conn.start_delivery_script(
                keys=[
                    lease,
                    running,
                    queued,
                    keys.cancel_flag(pair[0]),
                    keys.dispatch(dispatch_id),
                    keys.holding(worker),
                    keys.holders(holder_node(worker)),
                ],
                args=[dispatch_id, ttl * 1000, worker, ttl, HOLDING_ENTRY_SECONDS],
            )
        )
        return bool(held), bool(owned), bool(cancelled), _seconds(published)

    def retake_lease(self, pair: BookPair, dispatch_id: str, worker: str, ttl: int) -> bool:
        """A running job's vanished lease taken back, with its delivery's markers, unless another dispatch holds it
        (`lua/retake_lease.lua`); one round trip."""
        keys = self.conn.keys
        return bool(
            self.conn.run(
                lambda: self.conn.retake_lease_script(
                    keys=[
                        keys.lease(*pair),
                        keys.running(dispatch_id),
                        keys.holding(worker),
                        keys.holders(holder_node(worker)),
                        keys.abandoned(dispatch_id),
                    ],
                    args=[dispatch_id, ttl * 1000, worker, ttl, HOLDING_ENTRY_SECONDS],
                )
            )
        )

    def abandon_delivery(self, holder: str, redelivered: str | None) -> tuple[str, str, bool] | None:
        """Let go of the job a dead worker process held (`lua/abandon_delivery.lua`): (its dispatch id, its stage,
        whether its lease was dropped too), or None when it held none still running. `redelivered`: the dispatch whose
        message the broker delivers again, which keeps its lease as it is for that delivery to run it."""
        keys = self.conn.keys
        entry = _holding_entry(self.conn.run(lambda: self.conn.client.get(keys.holding(holder))))
        if entry is None:
            return None
        dispatch_id, lease = entry
        freed, dropped = self.conn.run(
            lambda: self.conn.abandon_delivery_script(
                keys=[keys.running(dispatch_id), lease, keys.holding(holder), keys.abandoned(dispatch_id)],
                args=[
                    holder,
                    dispatch_id,
                    stop_marker(dispatch_id),
                    "1" if redelivered == dispatch_id else "0",
                    ABANDONED_MARK_SECONDS,
                ],
            )
        )
        return (dispatch_id, keys.parse_lease(lease)[3], bool(dropped)) if freed else None

    def abandon_node(self, node: str) -> list[tuple[str, str, bool]]:
        """At a worker's start, before it runs anything: let go of what its previous run's processes still held
        (that run was killed), as `abandon_delivery` with no redelivery. What was let go, as there."""
        keys = self.conn.keys
        holders: Any = self.conn.run(lambda: self.conn.client.smembers(keys.holders(node)))
        freed = [f for holder in sorted(holders) if (f := self.abandon_delivery(holder, None)) is not None]
        self.conn.run(lambda: self.conn.client.delete(keys.holders(node)))
        return freed

    def node_jobs(self, node: str) -> list[tuple[BookPair, str]]:
        """(pair, dispatch id) of the jobs the processes of worker `node` run (their holder entries, kept jobs too); two
        round trips."""
        return self._entries([node])

    def held_jobs(self, nodes: Sequence[str]) -> list[tuple[BookPair, str]]:
        """(pair, dispatch id) of the jobs the processes of `nodes` run that still hold their pair's lease (not one
        that ended, was taken over or fenced off: those hold none, another dispatch's or a stop marker); three round
        trips, bounded by those nodes' processes."""
        jobs = self._entries(nodes)
        holders = self._values([self.conn.keys.lease(*pair) for pair, _ in jobs])
        return [(pair, d) for (pair, d), holder in zip(jobs, holders, strict=True) if holder == d]

    def _entries(self, nodes: Sequence[str]) -> list[tuple[BookPair, str]]:
        """(pair, dispatch id) that the holder entries of the processes of `nodes` name; two round trips."""
        keys = self.conn.keys
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for node in nodes:
                pipe.smembers(keys.holders(node))
            holders = sorted({h for members in (pipe.execute() if nodes else []) for h in members})
        entries = [_holding_entry(e) for e in self._values([keys.holding(h) for h in holders])]
        return [(keys.parse_lease(lease), dispatch_id) for dispatch_id, lease in filter(None, entries)]

    def delivery_holders(self, dispatch_ids: Sequence[str]) -> list[str | None]:
        """Which process runs each dispatch (its running marker: `<node>#<pid>`), None where none does."""
        return [None if h is None else str(h) for h in self._values([self.conn.keys.running(d) for d in dispatch_ids])]

    def touch_delivery(self, dispatch_id: str, ttl: int) -> None:
        self.conn.run(lambda: self.conn.client.expire(self.conn.keys.running(dispatch_id), ttl))

    def end_delivery(self, dispatch_id: str) -> None:
        with self.conn.writes() as pipe:
            pipe.delete(self.conn.keys.running(dispatch_id))

    def batched(self) -> AbstractContextManager[None]:
        """The writes of the lease and deferral stores made in the block by this thread go in one round trip."""
        return self.conn.batched()


def _holding_entry(raw: object) -> tuple[str, str] | None:
    """A holder entry (`start_delivery.lua`, `retake_lease.lua`) as (dispatch id, lease key); None when absent."""
    if raw is None or "\n" not in str(raw):
        return None
    dispatch_id, lease = str(raw).split("\n", 1)
    return dispatch_id, lease


def _seconds(raw: object) -> float | None:
    """A time written as a string (`take_leases`' metadata); None when absent or unreadable."""
    try:
        return float(str(raw)) if raw is not None else None
    except ValueError:
        return None
