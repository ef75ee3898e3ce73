"""A queue backlog longer than the lease TTL on RabbitMQ: waiting jobs are alive, nothing is dispatched twice.

On AMQP the broker cannot be peeked at, so before the undelivered markers (see `domain/liveness.py`)
reconcile took every job that waited in its queue longer than its lease TTL for lost and dispatched
it again, over and over (fencing kept it safe, but the queue filled with dead copies).
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.integration.helpers import make_book

from .harness import amqp_queue_depth, audio_stage, image_stage, stage_table

pytestmark = [pytest.mark.e2e, pytest.mark.amqp]

SCENES = 10
JOB = {"steps": 4, "step_seconds": 0.25}  # about 1 s per job on the one image worker
LEASE_TTL = 3


def test_a_backlog_longer_than_the_lease_ttl_is_not_dispatched_again(make_stack, figure, amqp_broker) -> None:
    # Lane, quota and window let the whole book be dispatched at once; one worker drains it in ~SCENES s,
    # so the last jobs wait about three lease TTLs in the queue, with a reconcile every 2 s.
    limits = {"lane_limit": SCENES, "book_quota": SCENES, "window": SCENES}
    stages = stage_table(audio=audio_stage(), image=image_stage(params=JOB, lease_ttl=LEASE_TTL, **limits))
    stack = make_stack(stages=stages, broker_url=amqp_broker.url, reconcile_seconds=2, presence_ttl_seconds=10)
    assert stack.settings.broker_is_amqp
    cluster = stack.cluster
    cluster.wait_ready(cluster.control(wait=False), cluster.gpu("image", wait=False), cluster.beat(wait=False))
    book = make_book("backlog-book", chapters=1, scenes=SCENES)
    stack.rt.catalog.import_book(book)

    began = time.monotonic()
    stack.client.regenerate(book.book_id, ["image"])
    peak = 0
    deadline = began + 5
    while time.monotonic() < deadline:  # the backlog builds at once
        peak = max(peak, amqp_queue_depth(amqp_broker.url, "gpu.image") or 0)
        time.sleep(0.2)
    rows = stack.wait_commands(book.book_id, ["image"], "completed", timeout=60)
    elapsed = time.monotonic() - began
    time.sleep(2 * stack.settings.reconcile_seconds)  # a few more reconciles over the finished book

    dispatches = stack.events("dispatch", book.book_id)
    per_pair = Counter((d["chapter_id"], d["scene_id"], d["stage"]) for d in dispatches)
    expired = stack.events("lease.expired", book.book_id)
    started = stack.events("job.started", book.book_id)
    figure(
        f"amqp backlog: {SCENES} image jobs, 1 worker, lease TTL {LEASE_TTL}s, reconcile 2s, peak depth {peak}:"
        f" dispatches {len(dispatches)} (max {max(per_pair.values())} per pair), leases expired {len(expired)},"
        f" jobs started {len(started)}, done in {elapsed:.1f}s"
    )
    assert peak >= SCENES - 3, f"no backlog built (peak depth {peak})"
    assert rows["image"].progress["ready"] == SCENES
    assert dict(per_pair) == {("ch1", f"s{i}", "image"): 1 for i in range(1, SCENES + 1)}, (
        f"pairs dispatched more than once: {sorted(p for p, n in per_pair.items() if n > 1)}"
    )
    assert expired == []
    assert len(started) == SCENES
    assert amqp_queue_depth(amqp_broker.url, "gpu.image") == 0
