"""The due index (which books need a gate pass, and from when) and the holds of the passes a batch or a regenerate
runs (flow/pass_hold.py).

A tick takes its due books off the index and sends their passes; a holder holds them while it runs, so one lost
with its control worker (control tasks are acknowledged when they start) leaves holds that lapse, and the tick sends
those passes again (`take_due`, with how many of each book's were lost in a row).
"""

from __future__ import annotations

from collections.abc import Sequence

from animastor_tasks.adapters.redis.cancel_flags import CancelFlagStore
from animastor_tasks.adapters.redis.connection import RedisConnection, _script
from animastor_tasks.domain.keys import held_pass_member, parse_held_pass_member
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.ports import DuePasses


class DueIndexStore(CancelFlagStore):
    def __init__(self, conn: RedisConnection) -> None:
        super().__init__(conn)
        self._due_clear = conn.client.register_script(_script("due_clear"))
        self._hold_passes = conn.client.register_script(_script("hold_passes"))

    def set_due(self, book: str, when: float) -> None:
        """The book needs its next pass by `when` (unix seconds): an earlier entry stands (ZADD LT), so a pass on
        a stale snapshot never puts back a book that something made due sooner meanwhile."""
        self.conn.run(lambda: self.conn.client.zadd(self.conn.keys.due(), {book: when}, lt=True))

    def ask_pass(self, book: str, seconds: float) -> bool:
        """Whether no pass of the book was asked for in the last `seconds` (this one then is)."""
        key, ms = self.conn.keys.pass_asked(book), max(1, round(seconds * 1000))
        return bool(self.conn.run(lambda: self.conn.client.set(key, "1", nx=True, px=ms)))

    def set_due_all(self, books: Sequence[str], when: float) -> None:
        """`set_due` of each of `books`, in one round trip."""
        if books:
            self.conn.run(lambda: self.conn.client.zadd(self.conn.keys.due(), dict.fromkeys(books, when), lt=True))

    def clear_due(self, book: str, seen: float) -> None:
        """No pass until something happens: the book off the due index, if its entry is still `seen`
        (`lua/due_clear.lua`)."""
        self.conn.run(
            lambda: self._due_clear(keys=[self.conn.keys.due()], args=[book, repr(seen)], client=self.conn.client)
        )

    def hold_passes(self, holder: str, books: Sequence[str], until: float) -> None:
        """`holder`'s passes of `books` are under way until `until`."""
        members = {held_pass_member(holder, b): until for b in books}
        if members:
            self.conn.run(lambda: self.conn.client.zadd(self.conn.keys.held_passes(), members))

    def renew_passes(
        self,
        holder: str,
        held: Sequence[str],
        until: float,
        *,
        ended: Sequence[str] = (),
        passed: Sequence[str] = (),
    ) -> int:
        """`holder`'s passes of `held` held on until `until`, those of `ended` let go (`lua/hold_passes.lua`), the
        lost passes of `passed` forgotten. Returns how many of `held` had lapsed (the tick sent them again)."""
        members = [held_pass_member(holder, b) for b in (*ended, *held)]
        if not members and not passed:
            return 0
        args: list[str | int] = [repr(until), len(ended), *members]
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            self._hold_passes(keys=[self.conn.keys.held_passes()], args=args, client=pipe)
            if passed:
                pipe.hdel(self.conn.keys.held_pass_lapses(), *passed)
            return int(pipe.execute()[0])

    def let_go_passes(self, holder: str, books: Sequence[str], *, passed: Sequence[str] = ()) -> None:
        """`holder`'s passes of `books` are over, the lost passes of `passed` forgotten."""
        if books or passed:
            with self.conn.errors():
                pipe = self.conn.client.pipeline(transaction=False)
                if books:
                    pipe.zrem(self.conn.keys.held_passes(), *(held_pass_member(holder, b) for b in books))
                if passed:
                    pipe.hdel(self.conn.keys.held_pass_lapses(), *passed)
                pipe.execute()

    def take_due(self, now: float) -> DuePasses:
        """The books due by `now` and those whose held pass lapsed by then, taken off the index and the holds in one
        step (their passes put them back as needed), so a book is asked for once however many ticks pass before its
        pass runs. *Why one step:* the holds taken, a refused take of the due books put the lapsed ones back on the
        index, and a book given up for its third lost pass went again, alone, at the next tick. The lapsed books'
        counts go up in a second round trip (one more each, here, where Redis refuses it: taken, they are sent)."""
        due, held, counts = self.conn.keys.due(), self.conn.keys.held_passes(), self.conn.keys.held_pass_lapses()
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=True)
            pipe.zrangebyscore(due, "-inf", now)
            pipe.zremrangebyscore(due, "-inf", now)
            pipe.zrangebyscore(held, "-inf", now)
            pipe.zremrangebyscore(held, "-inf", now)
            pipe.hgetall(counts)
            books, _, taken, _, counted = pipe.execute()
        lapses = {str(b): int(n) for b, n in counted.items()}
        lapsed = list(dict.fromkeys(parse_held_pass_member(member) for member in taken))
        if lapsed:
            try:
                with self.conn.errors():
                    pipe = self.conn.client.pipeline(transaction=False)
                    for book in lapsed:
                        pipe.hincrby(counts, book, 1)
                    lapses.update(zip(lapsed, map(int, pipe.execute()), strict=True))
            except StoreUnavailable:
                lapses.update({b: lapses.get(b, 0) + 1 for b in lapsed})
        return DuePasses([str(b) for b in books], lapsed, lapses)
