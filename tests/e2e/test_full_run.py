"""A whole book through the public path: Client -> control worker -> GPU workers -> Postgres + files."""

from __future__ import annotations

import time

import pytest

from animastor_tasks.dev.samples import load_sample_book
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e


def run_full_book(stack: Stack, figure: object, label: str) -> None:
    """Import the 20-scene sample book, regenerate all, and check every durable outcome."""
    cluster = stack.cluster
    procs = [cluster.control(wait=False), cluster.gpu("audio", wait=False), cluster.gpu("image", wait=False)]
    procs.append(cluster.beat(wait=False))
    cluster.wait_ready(*procs)

    book = load_sample_book()
    stack.rt.catalog.import_book(book)
    pairs = {(c, s, st) for c, s, st in stack.states(book.book_id)}
    assert len(pairs) == 40

    started = time.monotonic()
    answer = stack.client.regenerate(book.book_id, ["all"])
    assert sorted(c["stage"] for c in answer["commands"]) == ["audio", "image"]
    assert answer["skipped"] == []
    rows = stack.wait_commands(book.book_id, ["audio", "image"], "completed", timeout=45)
    wall = time.monotonic() - started

    assert set(stack.states(book.book_id).values()) == {"ready"}
    for stage in ("audio", "image"):
        row = rows[stage]
        assert row.targets == 20 and row.progress["ready"] == 20, (stage, row)
        assert row.reason is None
    artifacts = stack.check_artifacts(book.book_id, pairs)
    assert len(artifacts) == 40
    media = {r["stage"]: r["path"] for r in artifacts}
    assert media["audio"].endswith(".wav") and media["image"].endswith(".png")

    dispatches = stack.events("dispatch", book.book_id)
    started_jobs = stack.events("job.started", book.book_id)
    ready = stack.events("job.ready", book.book_id)
    # A fresh book: each pair dispatched once (token 1), started once, committed once.
    assert len(dispatches) == len(started_jobs) == len(ready) == 40
    assert {d["detail"]["token"] for d in dispatches} == {1}
    assert len({d["dispatch_id"] for d in dispatches}) == 40
    figure(f"{label}: 40 pairs ready in {wall:.2f}s (regenerate sent -> both commands completed)")


def test_full_book_run_redis(make_stack, figure) -> None:
    run_full_book(make_stack(), figure, "redis broker")
