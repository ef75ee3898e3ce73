"""Per-book coordination state: cancel flags (`cancel_flags.py`), the due index (`due_index.py`), the force set,
the active index, and the one-round-trip snapshot a gate pass reads.

Everything here can be rebuilt from Postgres (see `flow.reconcile`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

import redis

from animastor_tasks.adapters.redis.cancel_flags import STOP_FLAG
from animastor_tasks.adapters.redis.connection import RedisConnection, _script
from animastor_tasks.adapters.redis.due_index import DueIndexStore
from animastor_tasks.domain.capacity import HANDED_HOLD_SECONDS
from animastor_tasks.domain.deferral import RANK_SCALE
from animastor_tasks.domain.keys import (
    DEFER_BUCKETS,
    held_pass_member,
    pair_member,
    parse_pair_member,
    parse_scene_member,
    scene_member,
)
from animastor_tasks.domain.types import Pair, SceneKey
from animastor_tasks.ports import Snapshot

# How long a Stop All's send stamp is kept: longer than a regenerate waits in the control queue behind others.
STOPS_KEPT_SECONDS = 86_400.0
WAITERS_READ = 16  # books read at the head of each queue's waiting list (the fair share looks at them)


QUEUE_REPLIES = 4  # a snapshot's replies per queue: live heartbeats, a breaker on record, the list's head, hand-overs


def _handed_lately(handed: dict[Any, Any], now: float) -> dict[str, int]:
    """Of a lane's hand-over records (book -> '<when> <wait score>'), the books handed a slot within
    `HANDED_HOLD_SECONDS` of `now` (the Redis server's clock, as the records'), with the rank they were handed it at."""
    held: dict[str, int] = {}
    for book, record in handed.items():
        when, _, score = str(record).partition(" ")
        try:
            if now - float(when) <= HANDED_HOLD_SECONDS:
                held[str(book)] = int(float(score) // RANK_SCALE)
        except ValueError:  # a record of another shape holds nothing
            continue
    return held


class BookStateStore(DueIndexStore):
    def __init__(self, conn: RedisConnection) -> None:
        super().__init__(conn)
        self._epoch: str | None = None  # the dataset token this process last saw (see `_seen_epoch`)
        self._data_lost_at = float("-inf")
        self._book_reads_if_small = conn.client.register_script(_script("book_reads_if_small"))
        self._drop_if_idle = conn.client.register_script(_script("drop_if_idle"))
        self._pair_facts = _script("pair_facts")  # EVAL in a pipeline: a registered script asks SCRIPT EXISTS first

    # -- one read for a whole gate pass ---------------------------------------
    def book_snapshots(
        self, books: Sequence[str], now: float, queues: Sequence[str] = (), *, waiters: int = WAITERS_READ
    ) -> dict[str, Snapshot]:
        """Everything Redis knows that the gate passes of `books` need, in one round trip (one book, or a
        tick's batch; the queues are read once); `waiters`: how many books at the head of each queue's
        waiting list to read (the fair share looks at them)."""
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            self._read_snapshots(pipe, books, now, queues, waiters)
            replies = pipe.execute()
        return self._parse_snapshots(replies, books, now, queues)

    def _read_snapshots(self, pipe: Any, books: Sequence[str], now: float, queues: Sequence[str], waiters: int) -> None:
        keys = self.conn.keys
        self._read_queues(pipe, queues, now, waiters)
        for book in books:
            pipe.exists(keys.cancel_flag(book))
            pipe.zscore(keys.due(), book)
            pipe.smembers(keys.force_set(book))
            pipe.smembers(keys.active_scenes(book))
            for bucket in DEFER_BUCKETS:
                pipe.zrangebyscore(keys.deferrals(book, bucket), f"({now}", "+inf")
                pipe.zrangebyscore(keys.deferrals(book, bucket), f"({now}", "+inf", start=0, num=1, withscores=True)

    def _parse_snapshots(
        self, replies: list[Any], books: Sequence[str], now: float, queues: Sequence[str]
    ) -> dict[str, Snapshot]:
        per_queue, per_book = self._split_replies(replies, queues, now)
        width = 4 + 2 * len(DEFER_BUCKETS)
        found: dict[str, Snapshot] = {}
        for n, book in enumerate(books):
            cancel, due_at, force, active, *deferred = per_book[n * width : (n + 1) * width]
            found[book] = self._snapshot(
                now,
                queues,
                per_queue,
                cancel,
                due_at,
                {parse_pair_member(m) for m in force},
                {parse_scene_member(m) for m in active},
                [{parse_pair_member(m) for m in members} for members in deferred[::2]],
                [float(first[0][1]) for first in deferred[1::2] if first],
            )
        return found

    def pair_snapshot(self, book: str, pairs: Sequence[Pair], now: float, queues: Sequence[str]) -> Snapshot:
        """What `book_snapshots` says, of a few pairs only and in one round trip whatever the book's size: a
        refill looks at its candidates, not at every deferral of the book. `active` is left empty."""
        keys = self.conn.keys
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            self._read_queues(pipe, queues, now, WAITERS_READ)
            pipe.exists(keys.cancel_flag(book))
            pipe.zscore(keys.due(), book)
            if pairs:
                facts = [keys.force_set(book), *(keys.deferrals(book, bucket) for bucket in DEFER_BUCKETS)]
                pipe.eval(self._pair_facts, len(facts), *facts, repr(now), *[pair_member(*p) for p in pairs])
            replies = pipe.execute()
        per_queue, (cancel, due_at, *found) = self._split_replies(replies, queues, now)
        forced_at, *in_buckets = found[0] if found else [[]] + [[None] for _ in DEFER_BUCKETS]
        forced = {pairs[i] for i in forced_at}
        deferred = [{pairs[i] for i in islice(places, 1, None)} for places in in_buckets]
        live = [float(places[0]) for places in in_buckets if places[0] is not None]  # each bucket's first end
        return self._snapshot(now, queues, per_queue, cancel, due_at, forced, set(), deferred, live)

    def _read_queues(self, pipe: Any, queues: Sequence[str], now: float, waiters: int) -> None:
        keys = self.conn.keys
        pipe.setnx(keys.epoch(), uuid.uuid4().hex)
        pipe.get(keys.epoch())
        for queue in queues:  # `now` by the server's clock (`Ports.clock`), as heartbeats are scored
            pipe.zcount(keys.consumers(queue), f"({now}", "+inf")
            pipe.exists(keys.breaker(queue))
            pipe.zrange(keys.lane_waiters(queue), 0, max(waiters, 1) - 1, withscores=True)
            pipe.hgetall(keys.lane_handed(queue))

    def _split_replies(self, replies: list[Any], queues: Sequence[str], now: float) -> tuple[list[Any], list[Any]]:
        """Notes the dataset token; the queues' replies, then the books'."""
        _, epoch, *rest = replies
        self._seen_epoch(epoch, now)
        return rest[: QUEUE_REPLIES * len(queues)], rest[QUEUE_REPLIES * len(queues) :]

    def _snapshot(
        self,
        now: float,
        queues: Sequence[str],
        per_queue: list[Any],
        cancel: Any,
        due_at: Any,
        force: set[Pair],
        active: set[SceneKey],
        deferred: list[set[Pair]],
        deferral_ends: list[float],
    ) -> Snapshot:
        return Snapshot(
            cancel_flag=bool(cancel),
            force=force,
            deferred=dict(zip(DEFER_BUCKETS, deferred, strict=True)),
            active=active,
            consumers={q: int(per_queue[QUEUE_REPLIES * i]) for i, q in enumerate(queues)},
            breaker_clean={q: not per_queue[QUEUE_REPLIES * i + 1] for i, q in enumerate(queues)},
            data_lost_at=self._data_lost_at,
            presence_unsure_since=self._lost_or_recovered_at(),
            waiters={
                q: {str(b): int(score // RANK_SCALE) for b, score in per_queue[QUEUE_REPLIES * i + 2]}
                for i, q in enumerate(queues)
            },
            places={
                q: {str(b): score % RANK_SCALE for b, score in per_queue[QUEUE_REPLIES * i + 2]}
                for i, q in enumerate(queues)
            },
            handed={q: _handed_lately(per_queue[QUEUE_REPLIES * i + 3], now) for i, q in enumerate(queues)},
            first_deferral_end=min(deferral_ends, default=None),
            due_at=None if due_at is None else float(due_at),
        )

    def _lost_or_recovered_at(self) -> float:
        """Since when Redis's presence cannot be trusted: it lost its data, or this process could not reach it (the
        workers' heartbeats lapsed with their own writes, and come back within a heartbeat of Redis)."""
        return max(self._data_lost_at, self.conn.recovered_at)

    def presence_unsure_since(self, now: float | None = None) -> float:
        """When this process noticed that Redis lost its data, or answered again after it could not reach it
        (-inf if never), checked now in one round trip: "no consumer" proves nothing for a presence TTL after."""
        now = self.conn.server_time() if now is None else now
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            pipe.setnx(self.conn.keys.epoch(), uuid.uuid4().hex)
            pipe.get(self.conn.keys.epoch())
            _, epoch = pipe.execute()
        self._seen_epoch(epoch, now)
        return self._lost_or_recovered_at()

    def server_started_at(self) -> float:
        """The latest the Redis server may have started, by its clock: its uptime back from now, plus the second that
        uptime's whole seconds may leave out; -inf where INFO is refused. *Why:* a process started after a restart
        saw nothing of it, and the leases the restart lost look lapsed."""
        with self.conn.errors():
            try:
                uptime = float(self.conn.client.info("server")["uptime_in_seconds"])
            except (redis.ResponseError, KeyError, TypeError, ValueError):
                return float("-inf")
        return self.conn.server_time() - uptime + 1.0

    def _seen_epoch(self, epoch: Any, now: float) -> None:
        """A dataset token other than the one seen before means Redis was emptied meanwhile.

        Why: presence lives only in Redis; right after a FLUSHALL or a restart every queue looks
        consumerless until the workers' next heartbeat, and a gate pass must not BLOCK a stage then.
        """
        value = None if epoch is None else str(epoch)
        if value is not None and self._epoch is not None and value != self._epoch:
            self._data_lost_at = now
        self._epoch = value if value is not None else self._epoch

    def start_work(
        self,
        book: str,
        pairs: Sequence[Pair],
        scenes: Sequence[SceneKey],
        *,
        force_ttl: int | None,
        snapshot: tuple[float, Sequence[str]] | None = None,
        most_scenes: int | None = None,
        lifted: str | None = None,
        hold: tuple[str, float] | None = None,
    ) -> Snapshot | None:
        """A regenerate's Redis side in one round trip: the cancel flag lifted again (a Stop All whose flag came
        between the regenerate's first lift and its commands left the book flagged, its new command active
        with nothing to run it) and the lift of request `lifted` ended, force set (or un-force), deferrals
        cleared, scenes in the active index; `hold` (holder, until): the book's first pass held (flow/pass_hold.py).
        `snapshot` (now, queues): the book's snapshot read after those writes, in the same round trip, for the
        gate pass that follows at once; `most_scenes`: only while the active index holds at most that many
        scenes (None for a bigger book: its sets are not read)."""
        members = [pair_member(*p) for p in pairs]
        force_key = self.conn.keys.force_set(book)
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=True)
            pipe.delete(self.conn.keys.cancel_flag(book))
            if lifted is not None:
                pipe.zrem(self.conn.keys.lifting(book), lifted)
            if members:
                if force_ttl is not None:
                    pipe.sadd(force_key, *members)
                    pipe.expire(force_key, force_ttl)
                else:
                    pipe.srem(force_key, *members)
                for bucket in DEFER_BUCKETS:
                    pipe.zrem(self.conn.keys.deferrals(book, bucket), *members)
                pipe.sadd(self.conn.keys.active_scenes(book), *(scene_member(c, s) for c, s in scenes))
                pipe.sadd(self.conn.keys.active_books(), book)
            if hold is not None:
                pipe.zadd(self.conn.keys.held_passes(), {held_pass_member(hold[0], book): hold[1]})
            writes = len(pipe)
            if snapshot is not None and most_scenes is not None:
                now, queues = snapshot
                self._read_queues(pipe, queues, now, WAITERS_READ)
                self._read_small_book(pipe, book, now, most_scenes)
            elif snapshot is not None:
                self._read_snapshots(pipe, [book], snapshot[0], snapshot[1], WAITERS_READ)
            replies = pipe.execute() if len(pipe) else []
        if snapshot is None:
            return None
        read = replies[writes:]
        if most_scenes is not None:
            *head, sets = read
            if sets is None:
                return None
            force, active, *deferred = sets
            read = [*head, force, active, *[_scored(d) if i % 2 else d for i, d in enumerate(deferred)]]
        return self._parse_snapshots(read, [book], *snapshot)[book]

    def _read_small_book(self, pipe: Any, book: str, now: float, most_scenes: int) -> None:
        """`_read_snapshots`' reads of one book, its sets only while it has at most `most_scenes` active."""
        keys = self.conn.keys
        pipe.exists(keys.cancel_flag(book))
        pipe.zscore(keys.due(), book)
        deferrals = [keys.deferrals(book, bucket) for bucket in DEFER_BUCKETS]
        self._book_reads_if_small(
            keys=[keys.force_set(book), keys.active_scenes(book), *deferrals],
            args=[most_scenes, repr(now)],
            client=pipe,
        )

    # -- active index --------------------------------------------------------------
    def activate(self, scenes_of: Mapping[str, Iterable[SceneKey]]) -> None:
        """Each book's scenes into the active index (one round trip for them all); a book not in the due index
        yet is due now (its pass decides)."""
        members = {book: [scene_member(c, s) for c, s in scenes] for book, scenes in scenes_of.items()}
        books = [book for book, scenes in members.items() if scenes]
        if not books:
            return
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=True)
            for book in books:
                pipe.sadd(self.conn.keys.active_scenes(book), *members[book])
            pipe.sadd(self.conn.keys.active_books(), *books)
            pipe.zadd(self.conn.keys.due(), dict.fromkeys(books, self.conn.server_time()), nx=True)
            pipe.execute()

    def deactivate(self, book: str, scenes: Iterable[SceneKey]) -> None:
        members = [scene_member(c, s) for c, s in scenes]
        if members:
            self.conn.run(lambda: self.conn.client.srem(self.conn.keys.active_scenes(book), *members))

    def active_scene_count(self, book: str) -> int:
        return int(self.conn.run(lambda: self.conn.client.scard(self.conn.keys.active_scenes(book))))

    def scan_active(self, book: str, count: int) -> Iterator[list[SceneKey]]:
        """The book's active scenes, about `count` at a time (SSCAN: a big book's set is never read whole)."""
        key, cursor = self.conn.keys.active_scenes(book), 0
        while True:
            with self.conn.errors():
                cursor, members = self.conn.client.sscan(key, cursor, count=count)
            if members:
                yield [parse_scene_member(str(m)) for m in members]
            if not cursor:
                return

    def drop_book_if_idle(self, book: str) -> None:
        """The book off the active set and the due index, its deferrals gone, if it has no active scene, atomically
        (`lua/drop_if_idle.lua`)."""
        keys = self.conn.keys
        deferrals = [keys.deferrals(book, bucket) for bucket in DEFER_BUCKETS]
        self.conn.run(
            lambda: self._drop_if_idle(
                keys=[keys.active_scenes(book), keys.active_books(), keys.due(), *deferrals],
                args=[book],
                client=self.conn.client,
            )
        )

    def active_books(self) -> set[str]:
        members: set[Any] = self.conn.run(lambda: self.conn.client.smembers(self.conn.keys.active_books()))
        return {str(m) for m in members}

    def stop_book(self, book: str, queues: Sequence[str] = (), sent_at: float | None = None) -> None:
        """Stop All, Redis side: flag set; force set, deferrals, active index and due entry gone, and the book off the
        waiting lists of `queues`, its hand-over records there gone too. *Why:* left there, it kept its place (an
        interactive one, say) with nothing to run, its fair share binding the books that waited after it until a
        hand-over served it and it passed on; a record left put it back (its refill failing in a Postgres failover,
        `lua/handed_keep.lua`, or lost, `lua/handed_restore.lua`). `sent_at`: when the Stop All was sent, kept a day
        (`void_if_stopped`)."""
        now = self.conn.server_time()
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=True)
            pipe.set(self.conn.keys.cancel_flag(book), STOP_FLAG)
            if sent_at is not None:
                _note_for_a_day(pipe, self.conn.keys.stops_sent(), book, sent_at, now, gt=True)
            pipe.delete(self.conn.keys.force_set(book), self.conn.keys.active_scenes(book))
            pipe.delete(*(self.conn.keys.deferrals(book, b) for b in DEFER_BUCKETS))
            pipe.srem(self.conn.keys.active_books(), book)
            pipe.zrem(self.conn.keys.due(), book)
            for queue in queues:
                pipe.zrem(self.conn.keys.lane_waiters(queue), book)
                pipe.hdel(self.conn.keys.lane_handed(queue), book)
            pipe.execute()

    def void_if_stopped(self, book: str, request: str, sent_at: float | None) -> bool:
        """Whether the regenerate `request` is void: sent (`sent_at`, by the broker's clock) before a Stop All of the
        book that was taken already, now or when it was first sent (a resend of a void one is void: *why:* it made the
        work its first sending's Stop All had stopped). Noted for a day."""
        keys, now = self.conn.keys, self.conn.server_time()
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            pipe.zscore(keys.voided(), request)
            pipe.zscore(keys.stops_sent(), book)
            voided, stopped = pipe.execute()
            if voided is None and (sent_at is None or stopped is None or float(stopped) <= sent_at):
                return False
            _note_for_a_day(pipe, keys.voided(), request, now, now)
            pipe.execute()
        return True


def _note_for_a_day(pipe: Any, key: str, member: str, score: float, now: float, *, gt: bool = False) -> None:
    """`member` noted at `score` in the zset `key` (`gt`: only raised), whose notes older than `STOPS_KEPT_SECONDS` go
    (by `now`, the server's clock) and which goes whole once none has been written for that long."""
    pipe.zadd(key, {member: score}, gt=gt)
    pipe.zremrangebyscore(key, "-inf", f"({now - STOPS_KEPT_SECONDS}")
    pipe.expire(key, int(STOPS_KEPT_SECONDS))


def _scored(flat: list[Any]) -> list[tuple[Any, float]]:
    """A script's WITHSCORES reply (member, score, ...) as redis-py gives it to a command: (member, score) pairs."""
    return [(flat[i], float(flat[i + 1])) for i in range(0, len(flat), 2)]
