"""Per-book coordination state: cancel flags, the layers mirror, the force set, the active
index, and the one-round-trip snapshot a gate pass reads.

Everything here can be rebuilt from Postgres (see `flow.reconcile`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.domain.keys import DEFER_BUCKETS, pair_member, parse_pair_member, parse_scene_member, scene_member
from animastor_tasks.domain.types import Pair, SceneKey
from animastor_tasks.ports import Snapshot


class BookStateStore:
    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn
        self._epoch: str | None = None  # the dataset token this process last saw (see `_seen_epoch`)
        self._data_lost_at = float("-inf")

    # -- cancel flag, layers mirror --------------------------------------------
    def set_cancel_flag(self, book: str) -> None:
        self.set_cancel_flags([book])

    def set_cancel_flags(self, books: Iterable[str]) -> None:
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for book in books:
                pipe.set(self.conn.keys.cancel_flag(book), "1")
            pipe.execute()

    def clear_cancel_flag(self, book: str) -> None:
        self.conn.run(lambda: self.conn.client.delete(self.conn.keys.cancel_flag(book)))

    def mirror_layers(self, book: str, raw: str | None) -> None:
        self.mirror_layers_many({book: raw})

    def mirror_layers_many(self, layers: dict[str, str | None]) -> None:
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for book, raw in layers.items():
                if raw is None:
                    pipe.delete(self.conn.keys.layers(book))
                else:
                    pipe.set(self.conn.keys.layers(book), raw)
            pipe.execute()

    # -- one read for a whole gate pass ---------------------------------------
    def book_snapshot(self, book: str, now: float, queues: Sequence[str] = ()) -> Snapshot:
        """Everything Redis knows that a gate pass needs, in one round trip."""
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            pipe.setnx(self.conn.keys.epoch(), uuid.uuid4().hex)
            pipe.get(self.conn.keys.epoch())
            pipe.exists(self.conn.keys.cancel_flag(book))
            pipe.smembers(self.conn.keys.force_set(book))
            for bucket in DEFER_BUCKETS:
                pipe.zrangebyscore(self.conn.keys.deferrals(book, bucket), f"({now}", "+inf")
            pipe.smembers(self.conn.keys.active_scenes(book))
            for queue in queues:
                pipe.zcount(self.conn.keys.consumers(queue), f"({now}", "+inf")
                pipe.exists(self.conn.keys.breaker(queue))
            _, epoch, cancel, force, *rest = pipe.execute()
        self._seen_epoch(epoch, now)
        deferred, active, per_queue = (
            rest[: len(DEFER_BUCKETS)],
            rest[len(DEFER_BUCKETS)],
            rest[len(DEFER_BUCKETS) + 1 :],
        )
        return Snapshot(
            cancel_flag=bool(cancel),
            force={parse_pair_member(m) for m in force},
            deferred={b: {parse_pair_member(m) for m in ms} for b, ms in zip(DEFER_BUCKETS, deferred, strict=True)},
            active={parse_scene_member(m) for m in active},
            consumers={q: int(per_queue[2 * i]) for i, q in enumerate(queues)},
            breaker_clean={q: not per_queue[2 * i + 1] for i, q in enumerate(queues)},
            data_lost_at=self._data_lost_at,
        )

    def data_lost_at(self, now: float | None = None) -> float:
        """When this process noticed that Redis lost its data (-inf if never), checked now in one round trip."""
        now = time.time() if now is None else now
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            pipe.setnx(self.conn.keys.epoch(), uuid.uuid4().hex)
            pipe.get(self.conn.keys.epoch())
            _, epoch = pipe.execute()
        self._seen_epoch(epoch, now)
        return self._data_lost_at

    def _seen_epoch(self, epoch: Any, now: float) -> None:
        """A dataset token other than the one seen before means Redis was emptied meanwhile.

        Why: presence lives only in Redis; right after a FLUSHALL or a restart every queue looks
        consumerless until the workers' next heartbeat, and a gate pass must not BLOCK a stage then.
        """
        value = None if epoch is None else str(epoch)
        if value is not None and self._epoch is not None and value != self._epoch:
            self._data_lost_at = now
        self._epoch = value if value is not None else self._epoch

    def cancel_flag_set(self, book: str) -> bool:
        return bool(self.conn.run(lambda: self.conn.client.exists(self.conn.keys.cancel_flag(book))))

    def start_work(
        self, book: str, pairs: Sequence[Pair], scenes: Sequence[SceneKey], *, force_ttl: int | None
    ) -> None:
        """A regenerate's Redis side in one round trip: force set (or un-force), deferrals cleared,
        scenes in the active index."""
        members = [pair_member(*p) for p in pairs]
        if not members:
            return
        force_key = self.conn.keys.force_set(book)
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=True)
            if force_ttl is not None:
                pipe.sadd(force_key, *members)
                pipe.expire(force_key, force_ttl)
            else:
                pipe.srem(force_key, *members)
            for bucket in DEFER_BUCKETS:
                pipe.zrem(self.conn.keys.deferrals(book, bucket), *members)
            pipe.sadd(self.conn.keys.active_scenes(book), *(scene_member(c, s) for c, s in scenes))
            pipe.sadd(self.conn.keys.active_books(), book)
            pipe.execute()

    # -- active index --------------------------------------------------------------
    def activate(self, book: str, scenes: Iterable[SceneKey]) -> None:
        members = [scene_member(c, s) for c, s in scenes]
        if not members:
            return
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=True)
            pipe.sadd(self.conn.keys.active_scenes(book), *members)
            pipe.sadd(self.conn.keys.active_books(), book)
            pipe.execute()

    def deactivate(self, book: str, scenes: Iterable[SceneKey]) -> None:
        members = [scene_member(c, s) for c, s in scenes]
        if members:
            self.conn.run(lambda: self.conn.client.srem(self.conn.keys.active_scenes(book), *members))

    def drop_book_if_idle(self, book: str) -> None:
        with self.conn.errors():
            if not self.conn.client.scard(self.conn.keys.active_scenes(book)):
                self.conn.client.srem(self.conn.keys.active_books(), book)

    def active_books(self) -> set[str]:
        members: set[Any] = self.conn.run(lambda: self.conn.client.smembers(self.conn.keys.active_books()))
        return {str(m) for m in members}

    def stop_book(self, book: str) -> None:
        """Stop All, Redis side: flag set; force set, deferrals and active index gone."""
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=True)
            pipe.set(self.conn.keys.cancel_flag(book), "1")
            pipe.delete(self.conn.keys.force_set(book), self.conn.keys.active_scenes(book))
            pipe.delete(*(self.conn.keys.deferrals(book, b) for b in DEFER_BUCKETS))
            pipe.srem(self.conn.keys.active_books(), book)
            pipe.execute()
