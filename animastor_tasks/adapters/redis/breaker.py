"""The circuit breaker per queue: N consecutive failures open it; after a cool-down one
test permit is handed out (half-open); its success closes it. Beside it, each worker node's failed runs of the
queue in a row: a node at N while the breaker stays closed (other nodes' runs succeed) is told `host`, and a run's
record tells its node's streak whatever the state. The moves are Lua scripts, so concurrent dispatchers never hand
out two permits. Times go by the Redis server's clock: a GPU host records the failures that a control host on
another clock reads the breaker by.
"""

from __future__ import annotations

from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.domain.liveness import FORGET_SILENT_NODE_SECONDS
from animastor_tasks.ports import RunRecorded


class BreakerStore:
    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn
        self._permits: dict[str, str] = {}  # queue -> the permit this process holds (its stored expiry)

    def breaker_acquire(self, queue: str, permit_seconds: float) -> str:
        key = self.conn.keys.breaker(queue)
        now = self.conn.server_time()
        permit = repr(now + permit_seconds)
        state = str(
            self.conn.run(lambda: self.conn.breaker_acquire_script(keys=[key], args=[now, permit_seconds, permit]))
        )
        if state == "permit":
            self._permits[queue] = permit
        return state

    def breaker_release(self, queue: str) -> bool:
        """Give back the unused test permit this process holds for `queue` (False: none, or it expired)."""
        permit = self._permits.pop(queue, None)
        if permit is None:
            return False
        key = self.conn.keys.breaker(queue)
        return bool(self.conn.run(lambda: self.conn.breaker_release_script(keys=[key], args=[permit])))

    def breaker_record(self, queue: str, ok: bool, threshold: int, cooldown: float) -> str:
        """A publish's result; its success never clears run failures."""
        return self._record(queue, ok, threshold, cooldown, False, None)[0]

    def breaker_record_run(
        self, queue: str, ok: bool, threshold: int, cooldown: float, node: str | None
    ) -> RunRecorded:
        """A job's run, and the streak of `node` (the worker node that ran it; None: counted on no node) beside it."""
        return RunRecorded(*self._record(queue, ok, threshold, cooldown, True, node))

    def _record(
        self, queue: str, ok: bool, threshold: int, cooldown: float, run: bool, node: str | None
    ) -> tuple[str, int]:
        keys = [self.conn.keys.breaker(queue)]
        args = ["ok" if ok else "fail", self.conn.server_time(), threshold, cooldown, "run" if run else "publish"]
        if run and node is not None:
            keys.append(self.conn.keys.breaker_host(queue, node))
            args.append(FORGET_SILENT_NODE_SECONDS)  # a node gone for good leaves nothing behind
        state, streak = self.conn.run(lambda: self.conn.breaker_record_script(keys=keys, args=args))
        return str(state), int(streak)

    def breaker_refuses_until(self, queue: str) -> float:
        """When a breaker that refused a pass may test its lane (Redis server's clock): its cool-down's end, or
        the end of the test permit another pass holds. 0: closed since."""
        raw = self.conn.run(lambda: self.conn.client.hmget(self.conn.keys.breaker(queue), "open_until", "permit_until"))
        return max(float(value or 0) for value in raw)

    def breaker_state(self, queue: str) -> str:
        raw = self.conn.run(lambda: self.conn.client.hgetall(self.conn.keys.breaker(queue)))
        open_until = float(raw.get("open_until", 0) or 0)
        if open_until == 0:
            return "closed"
        return "open" if self.conn.server_time() < open_until else "half-open"
