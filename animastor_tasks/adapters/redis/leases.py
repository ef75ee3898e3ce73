"""Leases (one per dispatched pair, renewed by its job) and delivery markers (one per running job)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.domain.types import BookPair


class LeaseStore:
    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn

    def take_leases(self, leases: Sequence[tuple[BookPair, str, int, dict[str, Any]]]) -> None:
        """Write lease + metadata for each (pair, dispatch id, ttl, metadata) in one round trip."""
        if not leases:
            return
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for pair, dispatch_id, ttl, meta in leases:
                pipe.set(self.conn.keys.lease(*pair), dispatch_id, ex=ttl)
                if meta:
                    meta_key = self.conn.keys.dispatch(dispatch_id)
                    pipe.hset(meta_key, mapping={k: str(v) for k, v in meta.items()})
                    pipe.expire(meta_key, ttl * 4)
            pipe.execute()

    def lease_holders(self, pairs: Sequence[BookPair]) -> list[str | None]:
        if not pairs:
            return []
        holders: list[Any] = self.conn.run(lambda: self.conn.client.mget([self.conn.keys.lease(*p) for p in pairs]))
        return [None if h is None else str(h) for h in holders]

    def renew_lease(self, pair: BookPair, dispatch_id: str, ttl: float) -> bool:
        return bool(
            self.conn.run(
                lambda: self.conn.renew_script(keys=[self.conn.keys.lease(*pair)], args=[dispatch_id, int(ttl * 1000)])
            )
        )

    def release_lease(self, pair: BookPair, dispatch_id: str) -> bool:
        return bool(
            self.conn.run(lambda: self.conn.release_script(keys=[self.conn.keys.lease(*pair)], args=[dispatch_id]))
        )

    def claim_delivery(self, dispatch_id: str, worker: str, ttl: int, book: str) -> tuple[bool, bool]:
        """(this delivery owns the dispatch, the book is cancelled), in one round trip.

        A second delivery of a dispatch that is still running (broker redelivery after a
        visibility timeout) finds the marker and does not run again.
        """
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            pipe.set(self.conn.keys.running(dispatch_id), worker, nx=True, ex=ttl)
            pipe.exists(self.conn.keys.cancel_flag(book))
            owned, cancelled = pipe.execute()
        return bool(owned), bool(cancelled)

    def touch_delivery(self, dispatch_id: str, ttl: int) -> None:
        self.conn.run(lambda: self.conn.client.expire(self.conn.keys.running(dispatch_id), ttl))

    def end_delivery(self, dispatch_id: str) -> None:
        self.conn.run(lambda: self.conn.client.delete(self.conn.keys.running(dispatch_id)))

    def drop_leases(self, pairs: Sequence[BookPair]) -> None:
        if pairs:
            self.conn.run(lambda: self.conn.client.delete(*(self.conn.keys.lease(*p) for p in pairs)))
