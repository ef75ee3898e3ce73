"""Short singleton locks: a second beat's tick or reconcile finds the lock taken and skips."""

from __future__ import annotations

from animastor_tasks.adapters.redis.connection import RedisConnection


class LockStore:
    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn

    def try_lock(self, name: str, seconds: float) -> bool:
        return bool(
            self.conn.run(lambda: self.conn.client.set(self.conn.keys.lock(name), "1", nx=True, px=int(seconds * 1000)))
        )
