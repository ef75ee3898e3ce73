"""Deferrals: pairs kept out of gate passes until a time, one sorted set per book and bucket;
and, per lane, the books waiting for one of its slots, oldest first.

A deferred pair costs a gate pass nothing but its share of the one snapshot read.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Sequence

from animastor_tasks.adapters.redis.connection import RedisConnection, _script
from animastor_tasks.domain.capacity import HANDED_HOLD_SECONDS
from animastor_tasks.domain.deferral import RANK_SCALE, SERVED_AFTER
from animastor_tasks.domain.keys import DEFER_BUCKETS, pair_member
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import DeferralBucket
from animastor_tasks.ports import Committed

HAND_OVER_SECONDS = 600  # a hand-over whose last refill never came (a control worker killed) is forgotten
DEFERRAL_KEY_SLACK_SECONDS = 60  # a deferral key outlives the deferral written last by this much


class DeferralStore:
    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn
        self._take = conn.client.register_script(_script("lane_take"))
        self._stranded = conn.client.register_script(_script("lanes_stranded"))
        self._restore = conn.client.register_script(_script("handed_restore"))
        self._keep = conn.client.register_script(_script("handed_keep"))
        self._done_lua = _script("handed_done")
        self._wait_lua = _script("lane_wait")

    def defer(self, book: str, bucket: str, pairs: Iterable[Pair], seconds: float, now: float) -> None:
        """The pairs deferred until `now + seconds`; the bucket's key lives that long and a minute more at least
        (each write sets its lifetime again: a shorter one only ends other deferrals early, and a deferral ended
        early costs a pass, never a dispatch the gate would refuse). *Why:* a pass that read its book before a
        Stop All and wrote after it left the key of a book nobody visits any more, for good."""
        mapping = {pair_member(*p): now + seconds for p in pairs}
        if mapping:
            key = self.conn.keys.deferrals(book, bucket)
            with self.conn.writes() as pipe:
                pipe.zadd(key, mapping)
                pipe.expire(key, math.ceil(seconds) + DEFERRAL_KEY_SLACK_SECONDS)

    def clear_deferrals(self, book: str, pairs: Iterable[Pair], buckets: Sequence[str] = DEFER_BUCKETS) -> None:
        members = [pair_member(*p) for p in pairs]
        if not members:
            return
        with self.conn.writes() as pipe:
            for bucket in buckets:
                pipe.zrem(self.conn.keys.deferrals(book, bucket), *members)

    def deferral_counts(self, books: Iterable[str], now: float) -> dict[str, int]:
        """Live deferred pairs per bucket across the given books (for operators)."""
        books = list(books)
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for book in books:
                for bucket in DEFER_BUCKETS:
                    pipe.zcount(self.conn.keys.deferrals(book, bucket), f"({now}", "+inf")
            counts = pipe.execute()
        totals = dict.fromkeys(DEFER_BUCKETS, 0)
        for i, count in enumerate(counts):
            totals[DEFER_BUCKETS[i % len(DEFER_BUCKETS)]] += int(count)
        return totals

    def books_waiting(self, queues: Sequence[str]) -> dict[str, int]:
        """How many books wait on each lane's list (for operators): the books sharing a full lane's next slots."""
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for queue in queues:
                pipe.zcard(self.conn.keys.lane_waiters(queue))
            counts = pipe.execute()
        return {queue: int(n) for queue, n in zip(queues, counts, strict=True)}

    def prune_deferrals(self, books: Iterable[str], now: float) -> None:
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for book in books:
                for bucket in DEFER_BUCKETS:
                    pipe.zremrangebyscore(self.conn.keys.deferrals(book, bucket), "-inf", now)
            pipe.execute()

    def wait_for_lane(
        self, queue: str, book: str, score: float, *, served: bool = False, job_lasts: float = 0.0
    ) -> None:
        """The book waits for a slot of `queue` (`domain.deferral.wait_score`: lower is served first).

        A book already waiting keeps its place, or moves up to a better score; one just `served` a slot of the
        lane takes `score` wherever it was. `job_lasts` (a refusal's: how long a job may run): a place the book was
        served with stands against `score` at the same priority that long (`lua/lane_wait.lua`).
        """
        key = self.conn.keys.lane_waiters(queue)
        with self.conn.writes() as pipe:
            if served or not job_lasts:
                pipe.zadd(key, {book: score}, lt=not served)
            else:
                pipe.eval(self._wait_lua, 1, key, book, repr(score), RANK_SCALE, SERVED_AFTER, job_lasts)

    def open_hand_over(self, books: int) -> str:
        """A hand-over of slots to `books` books at once: its id, whose count `close_hand_over` takes down."""
        batch = uuid.uuid4().hex
        self.conn.run(lambda: self.conn.client.set(self.conn.keys.handing(batch), books, ex=HAND_OVER_SECONDS))
        return batch

    def close_hand_over(self, batch: str) -> bool:
        """One book of the hand-over has had its refill; True for the last one (or one whose count is gone), which
        takes the count away."""
        key = self.conn.keys.handing(batch)
        if int(self.conn.run(lambda: self.conn.client.decr(key))) > 0:
            return False
        self.conn.run(lambda: self.conn.client.delete(key))
        return True

    def hand_over_done(self, queue: str, book: str, began: float) -> None:
        """The refill of `book` handed a slot of `queue`, begun at `began` (`Ports.clock`), has claimed it or done its
        work: its hand-over record goes, unless a later hand-over wrote it (`lua/handed_done.lua`). A write of the
        open batch, if any (a claim's: sent as the script's text, as `release_leases` does)."""
        with self.conn.writes() as pipe:
            pipe.eval(self._done_lua, 1, self.conn.keys.lane_handed(queue), book, repr(began))

    def hand_over_again(self, queue: str, book: str, at: float, score: float) -> None:
        """`book`'s hand-over record again, as of `at` at wait score `score`, unless a later hand-over wrote one: the
        claim whose batch took it away (`hand_over_done`) did not commit."""
        with self.conn.writes() as pipe:
            pipe.hsetnx(self.conn.keys.lane_handed(queue), book, f"{at!r} {score!r}")

    def keep_handed_place(self, queue: str, book: str) -> None:
        """A handed book whose refill could not read it waits again at the head of the priority it was handed the
        slot with (`lua/handed_keep.lua`; with no hand-over record, of the place it holds; with neither, nowhere)."""
        keys = [self.conn.keys.lane_handed(queue), self.conn.keys.lane_waiters(queue)]
        args: list[str | float] = [book, RANK_SCALE]
        self.conn.run(lambda: self._keep(keys=keys, args=args))

    def restore_lost_hand_overs(self, queues: Sequence[str], min_age: float) -> list[tuple[str, str]]:
        """(queue, book) of the books handed a slot at least `min_age` seconds ago whose refills never reported
        back, each put back on the waiting list at the place it had (`lua/handed_restore.lua`)."""
        if not queues:
            return []
        keys = [k for q in queues for k in (self.conn.keys.lane_handed(q), self.conn.keys.lane_waiters(q))]
        found = self.conn.run(lambda: self._restore(keys=keys, args=[min_age]))
        return [(queues[int(found[i]) - 1], str(found[i + 1])) for i in range(0, len(found), 2)]

    def stranded_lanes(self, free: Sequence[str], min_age: float) -> list[str]:
        """Of the lanes with free slots now (`free`), those with books waiting for them that were seen so at least
        `min_age` seconds ago too (`lua/lanes_stranded.lua`): their refills were lost, not on their way."""
        keys = [self.conn.keys.lanes_seen_free(), *(self.conn.keys.lane_waiters(q) for q in free)]
        found = self.conn.run(lambda: self._stranded(keys=keys, args=[min_age, *free], client=self.conn.client))
        return [str(q) for q in found]

    def next_waiters(
        self,
        queue: str,
        count: int,
        *,
        exclude: str | None = None,
        ended: tuple[str, Committed] | None = None,
    ) -> list[str]:
        """Take up to `count` books that waited longest for `queue` (not `exclude`) at the head's priority, off the
        waiting list, in one atomic call (two concurrent hand-overs never take the same book).

        `ended`: the job whose end freed the slot, its dispatch id and what its commit, failure or give-back left
        its book (`Jobs.commit_job`); when a book is taken, `exclude` (that job's book) queues behind the waiters
        at its own priority, so books take turns: the more urgent of its place on the list and its most urgent
        pending pair's. With nothing left pending, or stopped (its cancel flag set: a Stop All since that read), it
        neither keeps the slot nor queues, and its place on the list goes. When that priority is more urgent than
        the head's, `exclude` keeps the slot: the answer is `[exclude]`, taken off the list.
        When nobody waits, the pairs of `exclude` deferred for capacity may try again on the slot its job
        freed: with `ended`, that bucket is emptied in the same step. While the lane's breaker is open
        nobody is taken (and `exclude` only joins the list), half-open one book at most (its test permit's): each
        other would find the lane refused and pass the slot on, emptying the list.
        A book handed a slot less than `HANDED_HOLD_SECONDS` ago whose refill has not reported back (off the list)
        still waits, at the score it was handed it with, for what the list leaves, and before less urgent books:
        more urgent than `ended`'s book, it takes the slot that book would keep; more urgent than the list's head,
        it is taken before the head; of slots `exclude` hands on (no `ended`), it takes those nobody listed waits
        for (not if handed with `exclude` by one hand-over, whose last refill hands on what is still free). Taken,
        it is handed one more slot (`lua/lane_take.lua`).
        """
        keys = [
            self.conn.keys.lane_waiters(queue),
            self.conn.keys.dispatch(ended[0]) if ended else "",
            self.conn.keys.deferrals(exclude, DeferralBucket.CAPACITY) if ended and exclude else "",
            self.conn.keys.breaker(queue),
            self.conn.keys.lane_handed(queue),
            self.conn.keys.cancel_flag(exclude) if ended and exclude else "",
        ]
        now = self.conn.server_time()  # the breaker's `open_until` is by the server's clock
        pending = "" if ended is None else "none" if ended[1].pending is None else ended[1].pending
        args: list[str | float] = [count, exclude or "", now, RANK_SCALE, pending, HANDED_HOLD_SECONDS]
        taken = self.conn.run(lambda: self._take(keys=keys, args=args))
        return [str(b) for b in taken]

    def leave_lanes(self, book: str, queues: Sequence[str]) -> None:
        """The book off these lanes' waiting lists: it has nothing pending there."""
        if queues:
            with self.conn.writes() as pipe:
                for queue in queues:
                    pipe.zrem(self.conn.keys.lane_waiters(queue), book)
