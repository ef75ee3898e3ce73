"""Stop All while slow jobs run: after cancel returns no job of the book starts, running ones stop at once."""

from __future__ import annotations

import time

import pytest

from tests.integration.helpers import make_book

from .harness import audio_stage, image_stage, stage_table, wait_for

pytestmark = pytest.mark.e2e

SLOW = {"steps": 8, "step_seconds": 0.5}


def test_cancel_mid_run_stops_running_jobs_and_starts_none(make_stack, figure) -> None:
    stack = make_stack(stages=stage_table(audio=audio_stage(params=SLOW), image=image_stage(params=SLOW)))
    cluster = stack.cluster
    audio, image = cluster.gpu("audio", wait=False), cluster.gpu("image", wait=False)
    cluster.wait_ready(cluster.control(wait=False), audio, image, cluster.beat(wait=False))
    book = make_book("cancel-book", chapters=2, scenes=5)
    stack.rt.catalog.import_book(book)
    stack.client.regenerate(book.book_id, ["all"])

    # Both GPU workers inside a job (a 4 s job), with more jobs of the book queued behind them.
    wait_for(lambda: {e["stage"] for e in stack.events("job.started", book.book_id)} == {"audio", "image"}, 20)
    time.sleep(0.7)
    states = stack.states(book.book_id)
    assert list(states.values()).count("generating") >= 2
    started = {e["dispatch_id"] for e in stack.events("job.started", book.book_id)}
    finished = {e["dispatch_id"] for e in stack.events("job.ready", book.book_id)}
    running = started - finished
    assert len(running) == 2, running

    sent = time.monotonic()
    answer = stack.client.cancel(book.book_id, reason="e2e stop all")
    returned = time.monotonic()
    cancelled_at = stack.db_now()
    assert len(answer["cancelled_commands"]) == 2 and answer["released"] >= 2

    # Nothing of the book is queued work any more, at once.
    states = stack.states(book.book_id)
    assert not {"pending", "generating"} & set(states.values()), states

    # The running jobs notice the cancel within 2 s of cancel returning.
    def stopped() -> bool:
        return all(
            any("stopping: book cancelled" in line for _, line in cluster.logs_mentioning(f"dispatch={d}"))
            for d in running
        )

    wait_for(stopped, timeout=5, interval=0.02, what="running jobs log 'stopping: book cancelled'")
    stop_latency = time.monotonic() - returned
    assert stop_latency <= 2.0, f"running jobs took {stop_latency:.2f}s to stop"
    for dispatch_id in running:
        done = wait_for(lambda d=dispatch_id: cluster.logs_mentioning(f"[{d}] succeeded"), 5, what="task result")
        assert "'outcome': 'stopped'" in done[0][1], done

    # Jobs still queued in the broker are delivered and refused; none starts.
    broker = stack.rt.redis.client
    wait_for(lambda: broker.llen("gpu.audio") == 0 and broker.llen("gpu.image") == 0, 15, what="queues drained")
    time.sleep(stack.settings.tick_seconds * 2 + stack.settings.reconcile_seconds)

    late = [e for e in stack.events("job.started", book.book_id) if e["at"] > cancelled_at]
    assert late == [], f"{len(late)} job(s) started after cancel returned"
    assert all(e["at"] <= cancelled_at for e in stack.events("job.ready", book.book_id))
    states = stack.states(book.book_id)
    assert set(states.values()) <= {"dirty", "ready"}, states
    ready = {pair for pair, state in states.items() if state == "ready"}
    stack.check_artifacts(book.book_id, ready)
    assert {r.status for r in stack.commands(book.book_id).values()} == {"cancelled"}
    assert stack.rt.ports.book_state.active_books() == set()
    dispatched = len(stack.events("dispatch", book.book_id))
    refused = sum(
        1
        for p in (audio, image)
        for line in p.log().splitlines()
        if "fence_rejected: cancelled" in line or "Discarding revoked task" in line
    )
    figure(
        f"cancel round trip {returned - sent:.3f}s; running jobs stopped {stop_latency:.3f}s after it returned; "
        f"dispatched {dispatched}, started {len(started)}, ready {len(ready)}, queued ones refused/revoked {refused}"
    )
