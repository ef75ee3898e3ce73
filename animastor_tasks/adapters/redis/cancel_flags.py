"""The cancel flag of each book (Stop All's first step, the flag alone stopping the book until its Postgres step's
tombstone stands) and a regenerate's lift of it.

Two values: a Stop All's own (`STOP_FLAG`), and a mirror of a Postgres tombstone (`MIRROR_FLAG`: reconcile, or a
refused regenerate putting back what it lifted). A mirror stands on its tombstone alone; a Stop All's own stops
the book without one (its Postgres step may have failed), unless a regenerate is lifting it (`lifting:<book>`).
"""

from __future__ import annotations

from collections.abc import Iterable

from animastor_tasks.adapters.redis.connection import RedisConnection, _script
from animastor_tasks.ports import LiftedFlag

STOP_FLAG = "stop"
MIRROR_FLAG = "1"
LIFT_SECONDS = 300  # a regenerate's lift counts as under way this long at most (its process may die before the end)


class CancelFlagStore:
    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn
        self._clear_if = conn.client.register_script(_script("clear_flag_if"))

    def cancel_flag_set(self, book: str) -> bool:
        return bool(self.conn.run(lambda: self.conn.client.exists(self.conn.keys.cancel_flag(book))))

    def set_cancel_flags(self, books: Iterable[str]) -> None:
        """Flags that mirror tombstones read from Postgres: never written over a Stop All's own (which says more)."""
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for book in books:
                pipe.set(self.conn.keys.cancel_flag(book), MIRROR_FLAG, nx=True)
            pipe.execute()

    def clear_mirror_flag(self, book: str) -> None:
        """The flag lifted only while it mirrors a tombstone: a Stop All's own stays."""
        self._clear_flag_if(book, MIRROR_FLAG)

    def clear_stop_flag(self, book: str) -> None:
        """A Stop All's own flag lifted: for a book Postgres does not hold, which a Stop All sent while Postgres did
        not answer flagged all the same."""
        self._clear_flag_if(book, STOP_FLAG)

    def _clear_flag_if(self, book: str, value: str) -> None:
        """The flag lifted only while it holds `value` (`lua/clear_flag_if.lua`): one of the other kind stays."""
        flag = self.conn.keys.cancel_flag(book)
        self.conn.run(lambda: self._clear_if(keys=[flag], args=[value], client=self.conn.client))

    def lift_cancel_flag(self, book: str, request: str, now: float) -> LiftedFlag:
        """A regenerate's first step: the flag deleted, and the lift counted as under way until its commands are
        written and `start_work(lifted=request)` ends it (or `end_lift`, the regenerate refused). Which flag was set
        ("stop": a Stop All's own; "mirror"), None if none.
        *Why:* a Stop All's flag that comes meanwhile is lifted again by `start_work`, and a pass that saw it
        must not release the new command's pairs as cancelled (`stop_stands`)."""
        flag, lifting = self.conn.keys.cancel_flag(book), self.conn.keys.lifting(book)
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=True)
            pipe.get(flag)
            pipe.delete(flag)
            pipe.zremrangebyscore(lifting, "-inf", now)
            pipe.zadd(lifting, {request: now + LIFT_SECONDS})
            pipe.expire(lifting, LIFT_SECONDS)
            was = pipe.execute()[0]
        return None if was is None else ("stop" if was == STOP_FLAG else "mirror")

    def end_lift(self, book: str, request: str, put_back: LiftedFlag = None) -> None:
        """A refused regenerate's lift ended, and the flag it lifted put back (`put_back`, as `lift_cancel_flag`
        answered; never over a flag set since), in one transaction."""
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=True)
            pipe.zrem(self.conn.keys.lifting(book), request)
            if put_back is not None:
                pipe.set(self.conn.keys.cancel_flag(book), STOP_FLAG if put_back == "stop" else MIRROR_FLAG, nx=True)
            pipe.execute()

    def stop_stands(self, book: str, now: float) -> bool:
        """Whether the book's flag is a Stop All's own with no regenerate lifting it: then it stops the book without
        its tombstone (a Stop All whose Postgres half failed, or is on its way). A flag that mirrors a tombstone
        stands on that tombstone alone: set from a read that a regenerate overtook, it is lifted again. Both read
        in one transaction: a regenerate's `start_work` comes wholly before or after."""
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=True)
            pipe.get(self.conn.keys.cancel_flag(book))
            pipe.zcount(self.conn.keys.lifting(book), f"({now}", "+inf")
            flag, lifting = pipe.execute()
        return bool(flag == STOP_FLAG and not lifting)
