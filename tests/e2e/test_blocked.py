"""BLOCKED: a stage with no live consumer publishes nothing and blocks its command; a worker + new command fix it."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from animastor_tasks.flow.lanes import HEARTBEAT_SLACK
from tests.integration.helpers import make_book
from tests.support.stack import Stack

from .harness import RedisQueueTap, wait_for

pytestmark = pytest.mark.e2e


def run_blocked(
    stack: Stack,
    figure: Callable[[str], None],
    label: str,
    pushes: Callable[[str], int] | None,
    depth: Callable[[str], int],
) -> None:
    """No image worker: audio completes, image is BLOCKED once a second count a heartbeat later finds no consumer
    either, and never reaches gpu.image.

    `pushes(queue)`: messages ever published to a queue (a broker-specific tap, None where the
    broker offers none); `depth(queue)`: the most messages seen waiting in it (LLEN on Redis,
    the passive-declare count on AMQP).
    """
    cluster, settings = stack.cluster, stack.settings
    cluster.wait_ready(cluster.control(wait=False), cluster.gpu("audio", wait=False), cluster.beat(wait=False))
    book = make_book("blocked-book", chapters=4, scenes=5)
    stack.rt.catalog.import_book(book)

    sent = time.monotonic()
    answer = stack.client.regenerate(book.book_id, ["all"])
    assert sorted(c["stage"] for c in answer["commands"]) == ["audio", "image"]

    def image_blocked() -> object:
        row = stack.commands(book.book_id).get("image")
        return row if row is not None and row.status == "blocked" else None

    # "No consumer" is counted again one heartbeat later before anything is blocked (`lanes.gone_for_good`).
    bound = settings.presence_ttl_seconds / 3 + HEARTBEAT_SLACK + settings.tick_seconds
    row = wait_for(image_blocked, timeout=bound + 2, interval=0.02, what="image command blocked")
    blocked_after = time.monotonic() - sent
    assert blocked_after <= bound, f"BLOCKED took {blocked_after:.2f}s, more than a heartbeat and a tick"
    assert row.reason == "no_worker:image"

    stack.wait_commands(book.book_id, ["audio"], "completed", timeout=30)
    # Two more ticks and a reconcile: nothing may retry the blocked stage or publish it late.
    time.sleep(settings.tick_seconds * 2 + settings.reconcile_seconds)
    rows = stack.commands(book.book_id)
    assert rows["image"].status == "blocked" and rows["audio"].status == "completed"
    states = stack.states(book.book_id)
    assert {s for (_, _, st), s in states.items() if st == "image"} == {"dirty"}
    assert {s for (_, _, st), s in states.items() if st == "audio"} == {"ready"}
    assert depth("gpu.image") == 0
    if pushes is not None:
        assert pushes("gpu.image") == 0, "a job was published to gpu.image with no consumer"
        # Sanity check of the tap: it sees the audio publishes. A job claimed for the slot its process's
        # last job freed is run there without a publish (worker/chain.py), so some of the 20 are not.
        assert 1 <= pushes("gpu.audio") <= 20, pushes("gpu.audio")
    dispatches = stack.events("dispatch", book.book_id)
    assert [e for e in dispatches if e["stage"] == "image"] == []
    assert len([e for e in dispatches if e["stage"] == "audio"]) == 20
    assert stack.events("job.started", book.book_id) and all(
        e["stage"] == "audio" for e in stack.events("job.started", book.book_id)
    )
    seen = f"0 image publishes, {pushes('gpu.audio')} audio (broker tap)" if pushes else "image queue depth 0 (no tap)"
    figure(f"{label}: image BLOCKED {blocked_after * 1000:.0f} ms after regenerate; {seen}")

    # A worker for the stage and a new explicit command: the stage runs.
    cluster.gpu("image")
    sent = time.monotonic()
    stack.client.regenerate(book.book_id, ["image"])
    rows = stack.wait_commands(book.book_id, ["image"], "completed", timeout=30)
    assert rows["image"].progress["ready"] == 20
    assert set(stack.states(book.book_id).values()) == {"ready"}
    stack.check_artifacts(book.book_id, stack.states(book.book_id))
    if pushes is not None:
        assert pushes("gpu.image") == 20
    figure(f"{label}: after starting an image worker, regenerate image completed in {time.monotonic() - sent:.2f}s")


def test_blocked_without_image_worker_redis(make_stack, figure) -> None:
    stack = make_stack()
    tap = RedisQueueTap(stack.env["ANIMASTOR_BROKER_URL"], ["gpu.audio", "gpu.image"])
    try:

        def pushes(queue: str) -> int:
            time.sleep(0.2)  # let the tap drain its notifications
            return tap.pushes[queue]

        run_blocked(stack, figure, "redis broker", pushes, lambda queue: tap.max_len[queue])
    finally:
        tap.close()
