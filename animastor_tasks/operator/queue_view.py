"""The queue overview's facts (`animastor-tasks queues`, the metrics exporter): per GPU queue, its consumers, depth,
running jobs, waiting books, breaker and deferrals, read from Redis, Postgres and the broker."""

from __future__ import annotations

from collections.abc import Mapping

from animastor_tasks.adapters.broker_probe import amqp_queue_counts, passive_depths
from animastor_tasks.contract import QueueRow
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import lanes
from animastor_tasks.worker.wiring import Wiring


def queue_overview(rt: Wiring, running: Mapping[str, int] | None = None) -> list[QueueRow]:
    """`running`: the lanes' generating pairs per stage, when the caller read them (None: read here)."""
    specs = rt.settings.stages
    queues = [s.queue for s in specs]
    now = rt.ports.clock()  # deferrals and heartbeats go by the Redis server's clock
    live = rt.presence.live_consumers(queues, now)
    # Each host's last beat as it wrote it: its own TTL may differ from this process's setting.
    beats = rt.presence.last_beats(sorted({host for hosts in live.values() for host in hosts}))
    amqp, depth = _broker_counts(rt.presence.amqp_url, rt.settings.broker_url, queues)
    running = rt.reads.lane_usage() if running is None else running
    deferred = rt.deferrals.deferral_counts(rt.ports.book_state.active_books(), now)
    waiting = rt.deferrals.books_waiting(queues)
    # A queue with no consumer whose worker stopped cleanly moments ago waits for its successor before its stage is
    # BLOCKED. *Why shown:* during a restart the view said only "none - start one", and not how long was left.
    awaited = lanes.successor_awaited(rt.ports, [q for q in queues if not live.get(q)])
    return [
        {
            "queue": spec.queue,
            "stage": spec.name,
            "consumers": [
                {
                    "hostname": host,
                    "heartbeat_age_seconds": round(
                        max(0.0, now - beats[host])
                        if host in beats
                        else rt.settings.presence_ttl_seconds - (exp - now),
                        1,
                    ),
                }
                for host, exp in sorted(live.get(spec.queue, {}).items())
            ],
            "broker_consumers": amqp.get(spec.queue),
            "depth": depth.get(spec.queue),
            "in_flight": running.get(spec.name, 0),
            "lane_limit": spec.lane_limit,
            "books_waiting": waiting[spec.queue],
            "breaker": rt.breaker.breaker_state(spec.queue),
            "deferred": deferred,
            "start_worker": f"animastor-tasks worker --stage {spec.name}",
            "successor_awaited_seconds": round(awaited[spec.queue], 1) if spec.queue in awaited else None,
        }
        for spec in specs
    ]


def _broker_counts(
    amqp_url: str | None, broker_url: str, queues: list[str]
) -> tuple[dict[str, int], dict[str, int | None]]:
    """(the AMQP broker's own consumer count per queue, messages waiting in each queue). The consumers: a
    connection the broker still holds counts, heartbeat or not; none without AMQP. Either unknown where the broker
    cannot say (null, `?`: never 0). On AMQP both come from one passive declare a queue: asked apart, a broker
    that never answered was waited for twice."""
    if not amqp_url:
        return {}, passive_depths(broker_url, queues)
    try:
        counts = amqp_queue_counts(amqp_url, queues)
    except StoreUnavailable:
        return {}, dict.fromkeys(queues)
    return {q: consumers for q, (_, consumers) in counts.items()}, {q: ready for q, (ready, _) in counts.items()}
