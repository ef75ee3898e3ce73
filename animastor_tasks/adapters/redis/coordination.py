"""Redis coordination: flags, force set, deferrals, active index, leases, presence, breaker.

Everything here can be rebuilt from Postgres (see `flow.reconcile`). Every read that
a gate pass needs for a whole book is one pipeline, so a pass costs a constant number
of round trips whatever the number of scenes. Driver errors become `StoreUnavailable`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

import redis

from animastor_tasks.domain.keys import (
    DEFER_BUCKETS,
    Keyspace,
    pair_member,
    parse_pair_member,
    parse_scene_member,
    scene_member,
)
from animastor_tasks.errors import StoreUnavailable

T = TypeVar("T")
Pair = tuple[str, str, str]
BookPair = tuple[str, str, str, str]


@dataclass(frozen=True)
class Snapshot:
    cancel_flag: bool
    force: set[Pair]
    deferred: dict[str, set[Pair]]  # live deferrals by bucket
    active: set[tuple[str, str]]  # the book's scenes in the active index
    consumers: dict[str, int]  # live heartbeats per queue asked for
    breaker_clean: dict[str, bool]  # no failure recorded: publishing needs no breaker call
    # When this process noticed that Redis lost its data (FLUSHALL, a restart without persistence);
    # -inf if never. Until every live worker has heartbeated again, "no consumer" is not evidence.
    data_lost_at: float = float("-inf")


def _script(name: str) -> str:
    return (resources.files("animastor_tasks.adapters.redis") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


class Coordination:
    def __init__(self, url: str, keys: Keyspace, *, socket_timeout: float = 5.0) -> None:
        self.url = url
        self.keys = keys
        self.client: redis.Redis = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        self._renew = self.client.register_script(_script("renew_lease"))
        self._release = self.client.register_script(_script("release_lease"))
        self._breaker_acquire = self.client.register_script(_script("breaker_acquire"))
        self._breaker_record = self.client.register_script(_script("breaker_record"))
        self._epoch: str | None = None  # the dataset token this process last saw (see `_seen_epoch`)
        self._data_lost_at = float("-inf")

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as err:
            raise StoreUnavailable("redis", self.url, str(err) or type(err).__name__) from err

    def _run(self, fn: Callable[[], T]) -> T:
        with self._errors():
            return fn()

    def ping(self) -> None:
        self._run(self.client.ping)

    def close(self) -> None:
        self.client.close()

    # -- cancel flag, layers mirror --------------------------------------------
    def set_cancel_flag(self, book: str) -> None:
        self.set_cancel_flags([book])

    def set_cancel_flags(self, books: Iterable[str]) -> None:
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for book in books:
                pipe.set(self.keys.cancel_flag(book), "1")
            pipe.execute()

    def clear_cancel_flag(self, book: str) -> None:
        self._run(lambda: self.client.delete(self.keys.cancel_flag(book)))

    def mirror_layers(self, book: str, raw: str | None) -> None:
        self.mirror_layers_many({book: raw})

    def mirror_layers_many(self, layers: dict[str, str | None]) -> None:
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for book, raw in layers.items():
                if raw is None:
                    pipe.delete(self.keys.layers(book))
                else:
                    pipe.set(self.keys.layers(book), raw)
            pipe.execute()

    # -- one read for a whole gate pass ---------------------------------------
    def book_snapshot(self, book: str, now: float, queues: Sequence[str] = ()) -> Snapshot:
        """Everything Redis knows that a gate pass needs, in one round trip."""
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.setnx(self.keys.epoch(), uuid.uuid4().hex)
            pipe.get(self.keys.epoch())
            pipe.exists(self.keys.cancel_flag(book))
            pipe.smembers(self.keys.force_set(book))
            for bucket in DEFER_BUCKETS:
                pipe.zrangebyscore(self.keys.deferrals(book, bucket), f"({now}", "+inf")
            pipe.smembers(self.keys.active_scenes(book))
            for queue in queues:
                pipe.zcount(self.keys.consumers(queue), f"({now}", "+inf")
                pipe.exists(self.keys.breaker(queue))
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
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.setnx(self.keys.epoch(), uuid.uuid4().hex)
            pipe.get(self.keys.epoch())
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
        return bool(self._run(lambda: self.client.exists(self.keys.cancel_flag(book))))

    def start_work(
        self, book: str, pairs: Sequence[Pair], scenes: Sequence[tuple[str, str]], *, force_ttl: int | None
    ) -> None:
        """A regenerate's Redis side in one round trip: force set (or un-force), deferrals cleared,
        scenes in the active index."""
        members = [pair_member(*p) for p in pairs]
        if not members:
            return
        force_key = self.keys.force_set(book)
        with self._errors():
            pipe = self.client.pipeline(transaction=True)
            if force_ttl is not None:
                pipe.sadd(force_key, *members)
                pipe.expire(force_key, force_ttl)
            else:
                pipe.srem(force_key, *members)
            for bucket in DEFER_BUCKETS:
                pipe.zrem(self.keys.deferrals(book, bucket), *members)
            pipe.sadd(self.keys.active_scenes(book), *(scene_member(c, s) for c, s in scenes))
            pipe.sadd(self.keys.active_books(), book)
            pipe.execute()

    # -- deferrals ---------------------------------------------------------------
    def defer(self, book: str, bucket: str, pairs: Iterable[Pair], seconds: float, now: float) -> None:
        mapping = {pair_member(*p): now + seconds for p in pairs}
        if mapping:
            self._run(lambda: self.client.zadd(self.keys.deferrals(book, bucket), mapping))

    def clear_deferrals(self, book: str, pairs: Iterable[Pair], buckets: Sequence[str] = DEFER_BUCKETS) -> None:
        members = [pair_member(*p) for p in pairs]
        if not members:
            return
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for bucket in buckets:
                pipe.zrem(self.keys.deferrals(book, bucket), *members)
            pipe.execute()

    def clear_bucket(self, book: str, bucket: str) -> None:
        """Every deferral of one bucket for a book (capacity freed: all its waiters may try again)."""
        self._run(lambda: self.client.delete(self.keys.deferrals(book, bucket)))

    def deferral_counts(self, books: Iterable[str], now: float) -> dict[str, int]:
        """Live deferred pairs per bucket across the given books (for operators)."""
        books = list(books)
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for book in books:
                for bucket in DEFER_BUCKETS:
                    pipe.zcount(self.keys.deferrals(book, bucket), f"({now}", "+inf")
            counts = pipe.execute()
        totals = dict.fromkeys(DEFER_BUCKETS, 0)
        for i, count in enumerate(counts):
            totals[DEFER_BUCKETS[i % len(DEFER_BUCKETS)]] += int(count)
        return totals

    def prune_deferrals(self, books: Iterable[str], now: float) -> None:
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for book in books:
                for bucket in DEFER_BUCKETS:
                    pipe.zremrangebyscore(self.keys.deferrals(book, bucket), "-inf", now)
            pipe.execute()

    # -- active index --------------------------------------------------------------
    def activate(self, book: str, scenes: Iterable[tuple[str, str]]) -> None:
        members = [scene_member(c, s) for c, s in scenes]
        if not members:
            return
        with self._errors():
            pipe = self.client.pipeline(transaction=True)
            pipe.sadd(self.keys.active_scenes(book), *members)
            pipe.sadd(self.keys.active_books(), book)
            pipe.execute()

    def deactivate(self, book: str, scenes: Iterable[tuple[str, str]]) -> None:
        members = [scene_member(c, s) for c, s in scenes]
        if members:
            self._run(lambda: self.client.srem(self.keys.active_scenes(book), *members))

    def drop_book_if_idle(self, book: str) -> None:
        with self._errors():
            if not self.client.scard(self.keys.active_scenes(book)):
                self.client.srem(self.keys.active_books(), book)

    def active_books(self) -> set[str]:
        members: set[Any] = self._run(lambda: self.client.smembers(self.keys.active_books()))
        return {str(m) for m in members}

    def stop_book(self, book: str) -> None:
        """Stop All, Redis side: flag set; force set, deferrals and active index gone."""
        with self._errors():
            pipe = self.client.pipeline(transaction=True)
            pipe.set(self.keys.cancel_flag(book), "1")
            pipe.delete(self.keys.force_set(book), self.keys.active_scenes(book))
            pipe.delete(*(self.keys.deferrals(book, b) for b in DEFER_BUCKETS))
            pipe.srem(self.keys.active_books(), book)
            pipe.execute()

    # -- leases and dispatch metadata ------------------------------------------------
    def take_leases(self, leases: Sequence[tuple[BookPair, str, int, dict[str, Any]]]) -> None:
        """Write lease + metadata for each (pair, dispatch id, ttl, metadata) in one round trip."""
        if not leases:
            return
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for pair, dispatch_id, ttl, meta in leases:
                pipe.set(self.keys.lease(*pair), dispatch_id, ex=ttl)
                if meta:
                    meta_key = self.keys.dispatch(dispatch_id)
                    pipe.hset(meta_key, mapping={k: str(v) for k, v in meta.items()})
                    pipe.expire(meta_key, ttl * 4)
            pipe.execute()

    def lease_holders(self, pairs: Sequence[BookPair]) -> list[str | None]:
        if not pairs:
            return []
        holders: list[Any] = self._run(lambda: self.client.mget([self.keys.lease(*p) for p in pairs]))
        return [None if h is None else str(h) for h in holders]

    def renew_lease(self, pair: BookPair, dispatch_id: str, ttl: float) -> bool:
        return bool(self._run(lambda: self._renew(keys=[self.keys.lease(*pair)], args=[dispatch_id, int(ttl * 1000)])))

    def release_lease(self, pair: BookPair, dispatch_id: str) -> bool:
        return bool(self._run(lambda: self._release(keys=[self.keys.lease(*pair)], args=[dispatch_id])))

    def claim_delivery(self, dispatch_id: str, worker: str, ttl: int, book: str) -> tuple[bool, bool]:
        """(this delivery owns the dispatch, the book is cancelled), in one round trip.

        A second delivery of a dispatch that is still running (broker redelivery after a
        visibility timeout) finds the marker and does not run again.
        """
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.set(self.keys.running(dispatch_id), worker, nx=True, ex=ttl)
            pipe.exists(self.keys.cancel_flag(book))
            owned, cancelled = pipe.execute()
        return bool(owned), bool(cancelled)

    def touch_delivery(self, dispatch_id: str, ttl: int) -> None:
        self._run(lambda: self.client.expire(self.keys.running(dispatch_id), ttl))

    def end_delivery(self, dispatch_id: str) -> None:
        self._run(lambda: self.client.delete(self.keys.running(dispatch_id)))

    def drop_leases(self, pairs: Sequence[BookPair]) -> None:
        if pairs:
            self._run(lambda: self.client.delete(*(self.keys.lease(*p) for p in pairs)))

    # -- consumer presence ------------------------------------------------------------
    def heartbeat(self, hostname: str, queues: Iterable[str], ttl: float, gone: Iterable[str] = ()) -> None:
        expires = time.time() + ttl
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for queue in queues:
                pipe.zadd(self.keys.consumers(queue), {hostname: expires})
            for queue in gone:
                pipe.zrem(self.keys.consumers(queue), hostname)
            pipe.execute()

    def live_consumers(self, queues: Sequence[str], now: float | None = None) -> dict[str, dict[str, float]]:
        """{queue: {hostname: heartbeat expiry}} for consumers whose heartbeat is still live."""
        now = time.time() if now is None else now
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for queue in queues:
                pipe.zrangebyscore(self.keys.consumers(queue), f"({now}", "+inf", withscores=True)
            answers = pipe.execute()
        return {queue: dict(members) for queue, members in zip(queues, answers, strict=False)}

    # -- circuit breaker -----------------------------------------------------------------
    def breaker_acquire(self, queue: str, permit_seconds: float) -> str:
        key = self.keys.breaker(queue)
        return str(self._run(lambda: self._breaker_acquire(keys=[key], args=[time.time(), permit_seconds])))

    def breaker_record(self, queue: str, ok: bool, threshold: int, cooldown: float) -> str:
        key = self.keys.breaker(queue)
        args = ["ok" if ok else "fail", time.time(), threshold, cooldown]
        return str(self._run(lambda: self._breaker_record(keys=[key], args=args)))

    def breaker_state(self, queue: str) -> str:
        raw = self._run(lambda: self.client.hgetall(self.keys.breaker(queue)))
        open_until = float(raw.get("open_until", 0) or 0)
        if open_until == 0:
            return "closed"
        return "open" if time.time() < open_until else "half-open"

    # -- singleton locks -------------------------------------------------------------------
    def try_lock(self, name: str, seconds: float) -> bool:
        return bool(self._run(lambda: self.client.set(self.keys.lock(name), "1", nx=True, px=int(seconds * 1000))))
