"""Short singleton locks: a second beat's tick or reconcile finds the lock taken and skips. And the bookmark
where a task that passes the farm in turns goes on (domain/rounds.py): lost with Redis's data, which that task
reads as "rebuild everything"."""

from __future__ import annotations

from animastor_tasks.adapters.redis.connection import RedisConnection


class LockStore:
    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn

    def try_lock(self, name: str, seconds: float) -> bool:
        return bool(
            self.conn.run(lambda: self.conn.client.set(self.conn.keys.lock(name), "1", nx=True, px=int(seconds * 1000)))
        )

    def bookmark(self, name: str) -> str | None:
        value = self.conn.run(lambda: self.conn.client.get(self.conn.keys.bookmark(name)))
        return None if value is None else str(value)

    def set_bookmark(self, name: str, value: str, *, kept: bool = False) -> None:
        """`kept`: only over a bookmark still there (SET XX), so that one lost with Redis's data stays lost."""
        self.conn.run(lambda: self.conn.client.set(self.conn.keys.bookmark(name), value, xx=kept))
