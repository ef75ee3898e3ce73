"""Redis out of memory (`maxmemory` reached, nothing it may evict) refuses every write for a while, then takes them
again. The workers ride it out as they ride out a Redis restart, and the command completes. Old code: kombu's ack
of the finished job was refused, Celery took it for an unrecoverable error, and the GPU worker exited (Redis memory
hunt); one started meanwhile exited within a second."""

from __future__ import annotations

import time

import pytest
import redis

from tests.e2e.harness import audio_stage, stage_table, wait_for
from tests.integration.helpers import make_book

from .checks import unauthorized_dispatches

pytestmark = [pytest.mark.faults, pytest.mark.e2e]


def test_workers_ride_out_a_full_redis(make_stack, redis_down_ok, figure, scale) -> None:
    stack = make_stack(stages=stage_table(audio=audio_stage(params={"steps": 4, "step_seconds": 0.5})))
    cluster = stack.cluster
    procs = [cluster.control(wait=False), cluster.gpu("audio", wait=False), cluster.beat(wait=False)]
    cluster.wait_ready(*procs)
    book = make_book("redis-full", chapters=1, scenes=3)
    stack.rt.catalog.import_book(book)
    stack.client.regenerate(book.book_id, ["audio"])
    wait_for(lambda: "generating" in stack.states(book.book_id).values(), 20, what="a job running")

    admin = redis.Redis.from_url(redis_down_ok.url)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)  # every write refused from now on
    full = time.monotonic()
    try:
        time.sleep(scale.pick(5.0, 15.0))  # past the running job's end: its ack is refused
        clients = int(admin.info("clients")["connected_clients"])
        late = cluster.gpu("audio", wait=False)  # a worker started while Redis is full
        time.sleep(5.0)
        dead = [p for p in [*procs, late] if not p.alive()]
        # It waits with Celery's backoff: restarted at once, it left about 12 connections a second open (review).
        opened = int(admin.info("clients")["connected_clients"]) - clients
    finally:
        admin.config_set("maxmemory", 0)
    outage = time.monotonic() - full
    assert dead == [], "\n".join(f"{p.name} exited while Redis was full:\n{p.tail()}" for p in dead)
    assert opened <= 8 and "Frequent restarts" not in late.log(), (opened, late.tail())

    sent = time.monotonic()
    stack.wait_commands(book.book_id, ["audio"], "completed", timeout=60)
    completed = time.monotonic() - sent
    assert set(stack.states(book.book_id).values()) == {"ready"}
    assert unauthorized_dispatches(stack) == []
    assert all(p.alive() for p in [*procs, late])
    figure(f"redis full {outage:.1f}s: control, beat and 2 audio workers rode it out; completed {completed:.1f}s after")
