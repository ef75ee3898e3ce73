"""On RabbitMQ a killed worker's connection closes at once and the broker counts its queue's consumers 0 while the
worker's last heartbeat is still live: that zero and its second count, a heartbeat later, BLOCKED the stage's commands
for good before a restart (systemd's `Restart=on-failure`, a container's restart policy) could beat. The stage is gone
once the heartbeat lapses, within a TTL, as on the Redis broker."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from animastor_tasks.adapters.redis.presence import PresenceStore
from animastor_tasks.flow import lanes
from animastor_tasks.worker.wiring import Wiring
from tests.support import missing

from .test_takeover import AMQP_URL, _amqp_reachable


def test_a_queue_whose_killed_worker_still_beats_is_not_gone_until_its_beat_lapses(rt: Wiring) -> None:
    if not _amqp_reachable():
        missing("RabbitMQ is not listening on 127.0.0.1:5672")
    from kombu import Connection, Queue

    queue = f"gpu.test-{uuid.uuid4().hex[:8]}"
    presence = PresenceStore(rt.redis, AMQP_URL)
    ports = replace(rt.ports, presence=presence)
    with Connection(AMQP_URL, connect_timeout=3) as conn:
        declared = Queue(queue, auto_delete=False)(conn.channel())
        declared.declare()  # nobody consumes it: the broker counts 0, as after a kill
        try:
            presence.heartbeat("killed@h", [queue], 2.0)  # its last beat, still live
            assert presence.counts([queue]) == {queue: 0}  # the broker's zero wins the count...
            assert lanes.gone_for_good(ports, [queue]) == set()  # ...but the stage is not gone yet
            time.sleep(2.2)  # the beat lapses: nobody restarted it
            assert lanes.gone_for_good(ports, [queue]) == {queue}
        finally:
            declared.delete()
