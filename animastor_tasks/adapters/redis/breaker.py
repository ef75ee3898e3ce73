"""The circuit breaker per queue: N consecutive failures open it; after a cool-down one
test permit is handed out (half-open); its success closes it. The moves are Lua scripts,
so concurrent dispatchers never hand out two permits.
"""

from __future__ import annotations

import time

from animastor_tasks.adapters.redis.connection import RedisConnection


class BreakerStore:
    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn

    def breaker_acquire(self, queue: str, permit_seconds: float) -> str:
        key = self.conn.keys.breaker(queue)
        return str(
            self.conn.run(lambda: self.conn.breaker_acquire_script(keys=[key], args=[time.time(), permit_seconds]))
        )

    def breaker_record(self, queue: str, ok: bool, threshold: int, cooldown: float) -> str:
        key = self.conn.keys.breaker(queue)
        args = ["ok" if ok else "fail", time.time(), threshold, cooldown]
        return str(self.conn.run(lambda: self.conn.breaker_record_script(keys=[key], args=args)))

    def breaker_state(self, queue: str) -> str:
        raw = self.conn.run(lambda: self.conn.client.hgetall(self.conn.keys.breaker(queue)))
        open_until = float(raw.get("open_until", 0) or 0)
        if open_until == 0:
            return "closed"
        return "open" if time.time() < open_until else "half-open"
