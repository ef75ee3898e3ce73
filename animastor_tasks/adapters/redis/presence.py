"""Consumer presence: each worker's heartbeat per queue, with a TTL, and the live count a
dispatch trusts.

A heartbeat writes `hostname -> expiry` into one sorted set per queue, by the Redis server's clock (hosts'
clocks differ; every reader of a heartbeat judges it by that clock too); a clean stop
removes it and, when that leaves the queue without a live consumer, notes when (a restart's
successor is given time to come); a SIGKILLed worker's entry expires within one TTL. On AMQP the broker's own
count may only lower it: a zero there wins (a killed worker's connection closes at once), unless a worker
*holds* the queue (it beats for it without a consumer: draining its jobs at a warm shutdown, or its consumer
restarting after a lost broker connection), and a count above zero never stands in for missing heartbeats.
A worker cut off by a partition leaves a half-open connection the broker keeps counting until its heartbeat
timeout; its heartbeats have stopped, so it is not live.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from animastor_tasks.adapters.broker_probe import amqp_consumer_counts
from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.domain.liveness import FORGET_SILENT_NODE_SECONDS

LIMITS_KEPT_SECONDS = 3600  # the control workers' stage limits, after their last heartbeat


class PresenceStore:
    def __init__(self, conn: RedisConnection, amqp_url: str | None = None) -> None:
        self.conn = conn
        self.amqp_url = amqp_url

    def heartbeat(
        self, hostname: str, queues: Iterable[str], ttl: float, gone: Iterable[str] = (), *, holding: bool = False
    ) -> set[str]:
        """`hostname` consumes `queues` for `ttl` seconds more (and no longer `gone`); its last beat is noted beside,
        whatever it consumes. A `ttl` of 0 with no queues is a clean stop: its last beat goes too. `holding`: it
        has no consumer on them for now (draining, or reconnecting to its broker), and will have one again or
        withdraw. Returns those of `queues` a pass was waiting for a worker on (`await_consumer`), now consumed."""
        now = self.conn.server_time(fresh=True)  # the server's clock: its readers run on other hosts
        keys = self.conn.keys
        queues = list(queues)
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for queue in [] if holding else queues:
                pipe.srem(keys.awaited(), queue)
            for queue in queues:
                pipe.zadd(keys.consumers(queue), {hostname: now + ttl})
                # Names silent for a day go: each pod a rollout replaced (a new name each time) stayed for ever.
                forget = f"({now - FORGET_SILENT_NODE_SECONDS}"
                pipe.zremrangebyscore(keys.consumers(queue), "-inf", forget)
                if holding:
                    pipe.zadd(keys.held(queue), {hostname: now + ttl})
                    pipe.zremrangebyscore(keys.held(queue), "-inf", forget)
                else:
                    pipe.zrem(keys.held(queue), hostname)
            for queue in gone:  # lua/withdraw_consumer.lua: its departure noted if it leaves nobody consuming
                pipe.zrem(keys.held(queue), hostname)
                self.conn.withdraw_consumer_script(
                    keys=[keys.consumers(queue), keys.departures()],
                    args=[hostname, now, queue],
                    client=pipe,
                )
            if ttl:
                pipe.zadd(self.conn.keys.beats(), {hostname: now})
            else:
                pipe.zrem(self.conn.keys.beats(), hostname)
            pipe.zremrangebyscore(self.conn.keys.beats(), "-inf", f"({now - FORGET_SILENT_NODE_SECONDS}")
            answers = pipe.execute()
        return set() if holding else {queue for queue, taken in zip(queues, answers, strict=False) if taken}

    def publish_limits(self, limits: Mapping[str, Any]) -> None:
        """A control worker's stage limits, which the other processes compare theirs with (`published_limits`)."""
        with self.conn.errors():
            self.conn.client.set(
                self.conn.keys.stage_limits(), json.dumps(limits, sort_keys=True), ex=LIMITS_KEPT_SECONDS
            )

    def published_limits(self) -> dict[str, Any] | None:
        """The control workers' stage limits, None when none is on record (or unreadable as JSON)."""
        with self.conn.errors():
            raw = self.conn.client.get(self.conn.keys.stage_limits())
        try:
            found = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        return found if isinstance(found, dict) else None

    def await_consumer(self, queues: Sequence[str]) -> None:
        """A pass waits for a worker on `queues` (a restarted one's successor): its first heartbeat says so."""
        with self.conn.errors():
            self.conn.client.sadd(self.conn.keys.awaited(), *queues)

    def last_beats(self, nodes: Sequence[str]) -> dict[str, float]:
        """{node: when it last beat} for those of `nodes` on record (by the server's clock), but a name silent for
        `FORGET_SILENT_NODE_SECONDS` (a heartbeat drops it). A read only: the queue view and the metrics exporter
        call it, and with a read-only Redis user (or a replica) its prune was refused, the view exited 3 and the
        exporter reported Redis down."""
        if not nodes:
            return {}
        forget_before = self.conn.server_time(fresh=True) - FORGET_SILENT_NODE_SECONDS
        with self.conn.errors():
            beats = self.conn.client.zmscore(self.conn.keys.beats(), list(nodes))
        return {
            node: float(beat)
            for node, beat in zip(nodes, beats, strict=True)
            if beat is not None and float(beat) >= forget_before
        }

    def nodes(self) -> list[str]:
        """Every worker node whose last heartbeat is on record (a name silent for a day is dropped by a heartbeat)."""
        with self.conn.errors():
            return [str(n) for n in self.conn.client.zrange(self.conn.keys.beats(), 0, -1)]

    def departed_ago(self, queues: Sequence[str]) -> dict[str, float]:
        """{queue: seconds since a consumer last stopped consuming it cleanly} for those of `queues` on record."""
        if not queues:
            return {}
        now = self.conn.server_time(fresh=True)
        with self.conn.errors():
            left = self.conn.client.zmscore(self.conn.keys.departures(), list(queues))
        return {queue: now - float(when) for queue, when in zip(queues, left, strict=True) if when is not None}

    def unconsumed_seen(self, queues: Sequence[str]) -> dict[str, float]:
        """{queue: when a double count last found it without a consumer} for those of `queues` on record."""
        with self.conn.errors():
            seen = self.conn.client.hmget(self.conn.keys.unconsumed(), list(queues))
        return {queue: float(when) for queue, when in zip(queues, seen, strict=True) if when is not None}

    def note_unconsumed(self, queues: Sequence[str]) -> None:
        """`queues` found without a consumer by two counts a heartbeat apart, now."""
        now = self.conn.server_time(fresh=True)
        with self.conn.errors():
            self.conn.client.hset(self.conn.keys.unconsumed(), mapping=dict.fromkeys(queues, now))

    def live_consumers(self, queues: Sequence[str], now: float | None = None) -> dict[str, dict[str, float]]:
        """{queue: {hostname: heartbeat expiry}} for consumers whose heartbeat is still live; expiries and `now` by
        the Redis server's clock (`RedisConnection.server_time`)."""
        now = self.conn.server_time(fresh=True) if now is None else now
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for queue in queues:
                pipe.zrangebyscore(self.conn.keys.consumers(queue), f"({now}", "+inf", withscores=True)
            answers = pipe.execute()
        return {queue: dict(members) for queue, members in zip(queues, answers, strict=False)}

    def counts(self, queues: Sequence[str], heartbeats: dict[str, int] | None = None) -> dict[str, int]:
        """Live consumers per queue; `heartbeats`: live heartbeat counts already read (a gate pass
        reads them in its snapshot)."""
        if heartbeats is None:
            live = self.live_consumers(queues)
            heartbeats = {q: len(live.get(q, {})) for q in queues}
        counts = {q: heartbeats.get(q, 0) for q in queues}
        beating = [q for q in queues if counts[q] > 0]
        if self.amqp_url and beating:  # nothing to ask where no heartbeat is live: the answer is zero already
            broker_counts = amqp_consumer_counts(self.amqp_url, beating)
            # *Why held queues keep their count:* a warm shutdown cancels the consumer before its job is done, and
            # the broker's zero BLOCKED the commands of a stage whose only worker a rollout replaced, for good.
            held = self.held([q for q in beating if not broker_counts.get(q, 0)])
            counts.update({q: min(counts[q], broker_counts.get(q, 0)) for q in beating if q not in held})
        return counts

    def held(self, queues: Sequence[str]) -> set[str]:
        """Those of `queues` that a live worker holds without a consumer (`heartbeat`'s `holding`)."""
        if not queues:
            return set()
        now = self.conn.server_time()
        with self.conn.errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for queue in queues:
                pipe.zcount(self.conn.keys.held(queue), f"({now}", "+inf")
            held = pipe.execute()
        return {queue for queue, count in zip(queues, held, strict=True) if count}
