"""Two beat processes at once (a misdeployed second scheduler) must be harmless: no pair is dispatched twice."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.integration.helpers import make_book

from .harness import audio_stage, image_stage, stage_table

pytestmark = pytest.mark.e2e

JOB = {"steps": 4, "step_seconds": 0.06}  # ~0.25 s per job, 50 per stage


def test_two_beats_dispatch_each_pair_once(make_stack, figure) -> None:
    stack = make_stack(
        stages=stage_table(audio=audio_stage(params=JOB, lease_ttl=5), image=image_stage(params=JOB, lease_ttl=5))
    )
    cluster = stack.cluster
    beats = [cluster.beat(wait=False), cluster.beat(wait=False)]
    control = cluster.control(wait=False)
    cluster.wait_ready(control, cluster.gpu("audio", wait=False), cluster.gpu("image", wait=False), *beats)
    book = make_book("two-beats", chapters=5, scenes=10)
    stack.rt.catalog.import_book(book)
    pairs = set(stack.states(book.book_id))
    assert len(pairs) == 100

    began = time.monotonic()
    stack.client.regenerate(book.book_id, ["all"])
    stack.wait_commands(book.book_id, ["audio", "image"], "completed", timeout=90)
    run_time = time.monotonic() - began
    # Keep both beats ticking for ~20 s in all: a finished book must stay untouched.
    time.sleep(max(0.0, 20.0 - run_time))
    observed = time.monotonic() - began

    for beat in beats:
        assert beat.alive()
        assert beat.log().count("Sending due task animastor-tick") >= 10, beat.tail()

    dispatches = stack.events("dispatch", book.book_id)
    per_token = Counter((e["chapter_id"], e["scene_id"], e["stage"], e["detail"]["token"]) for e in dispatches)
    duplicates = {k: n for k, n in per_token.items() if n > 1}
    assert duplicates == {}, f"pairs dispatched twice under one token: {duplicates}"
    assert len({e["dispatch_id"] for e in dispatches}) == len(dispatches)
    starts = Counter(e["dispatch_id"] for e in stack.events("job.started", book.book_id))
    assert max(starts.values()) == 1, {d: n for d, n in starts.items() if n > 1}
    # Every dispatch beyond one per pair must be explained by an expired lease (there should be none).
    expired = stack.events("lease.expired", book.book_id)
    assert len(dispatches) == len(pairs) + len(expired), (len(dispatches), len(expired))
    assert expired == []
    assert set(stack.states(book.book_id).values()) == {"ready"}
    stack.check_artifacts(book.book_id, pairs)
    log = control.log().splitlines()
    gates = sum(1 for line in log if "Task animastor.gate[" in line and "received" in line)
    gates += sum(1 for line in log if "Task animastor.refill[" in line and "received" in line)
    ticks = [line for line in log if "Task animastor.tick[" in line and "succeeded" in line]
    idle = sum(1 for line in ticks if line.endswith(": []"))
    figure(
        f"100 pairs ready in {run_time:.1f}s under 2 beats (watched {observed:.1f}s): dispatches {len(dispatches)}, "
        f"duplicate (pair, token) 0, job starts {sum(starts.values())}, gate passes {gates}, "
        f"tick tasks {len(ticks)} ({idle} skipped by the tick lock or idle)"
    )
