"""Issue 7, item 10: a job that runs longer than the broker's visibility timeout is delivered a second time
while the first copy still runs; the duplicate is detected and nothing is committed twice.

How the redelivery is produced, for real: `Settings` insists on soft limit < hard limit < visibility timeout
(a job must be stopped before the broker would redeliver it), so one worker cannot both run a long job and
have a short visibility timeout. Kombu's Redis transport restores unacked messages older than the visibility
timeout *of the process that sweeps* (every worker sweeps once when its consumer starts). So the job runs on
worker A (defaults: 1800/1900/3600 s); once it has been unacked for more than 3 s, a second image worker B
starts with ANIMASTOR_VISIBILITY_TIMEOUT=3 (soft/hard limits 1/2 s, which the duplicate never needs): its
start-up sweep puts A's message back on `gpu.image` and B, idle, receives it: exactly what a broker does
when a job outlives the visibility timeout. Pass criterion: B reports `duplicate_delivery` (log and metric),
the pair is committed once (1 artifact row, 1 job.ready, 1 job.started) by A.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.harness import audio_stage, generate_lines, image_stage, stage_table, wait_for
from tests.integration.helpers import make_book

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

VISIBILITY = 3
LONG_JOB = {"steps": 24, "step_seconds": 0.5}  # 12 s: much longer than the 3 s visibility timeout


def test_job_longer_than_the_visibility_timeout_is_not_committed_twice(make_stack, figure, scale) -> None:
    trials = scale.pick(1, 2)
    stack = make_stack(stages=stage_table(audio=audio_stage(), image=image_stage(params=LONG_JOB)))
    cluster = stack.cluster
    first = cluster.gpu("image", wait=False)
    cluster.wait_ready(cluster.control(wait=False), first, cluster.beat(wait=False))
    book = make_book("redelivered", chapters=1, scenes=trials)
    stack.rt.catalog.import_book(book)
    coord = stack.rt
    short = {
        "ANIMASTOR_VISIBILITY_TIMEOUT": str(VISIBILITY),
        "ANIMASTOR_JOB_SOFT_TIME_LIMIT": "1",
        "ANIMASTOR_JOB_TIME_LIMIT": "2",
    }

    detected: list[float] = []
    for trial in range(trials):
        pair = ("ch1", f"s{trial + 1}", "image")
        stack.client.regenerate(book.book_id, ["image"], [pair[:2]])
        started = wait_for(
            lambda p=pair: [e for e in stack.events("job.started", book.book_id) if e["scene_id"] == p[1]],
            20,
            what="the long job started",
        )
        dispatch_id = started[0]["dispatch_id"]
        # The start's event commits a moment before the worker logs it: wait for the line, do not race it.
        wait_for(
            lambda d=dispatch_id: any(" started on " in line for line in generate_lines(first, d)),
            5,
            what="the first worker logged the start",
        )
        time.sleep(VISIBILITY + 0.3)  # unacked for longer than the short visibility timeout
        second = cluster.gpu("image", env=short)  # its consumer start sweeps and restores the message
        lines = wait_for(
            lambda p=second, d=dispatch_id: [ln for ln in generate_lines(p, d) if "succeeded in" in ln],
            20,
            what="the second delivery answered by the second worker",
        )
        detected.append(time.monotonic())
        assert "'outcome': 'duplicate_delivery'" in lines[0], lines
        assert any("duplicate delivery while another copy runs" in ln for ln in generate_lines(second, dispatch_id))
        assert not any(" started on " in ln for ln in generate_lines(second, dispatch_id))
        running_still = stack.asset_rows(book.book_id)[pair]
        assert running_still["state"] == "generating" and running_still["dispatch_id"] == dispatch_id, (
            "the first copy finished before the duplicate arrived: the test did not overlap them"
        )
        stack.wait_commands(book.book_id, ["image"], "completed", timeout=30)
        cluster.stop(second)

        ready = [e for e in stack.events("job.ready", book.book_id) if e["scene_id"] == pair[1]]
        assert [e["dispatch_id"] for e in ready] == [dispatch_id], ready
        rows = [r for r in stack.artifacts(book.book_id) if r["scene_id"] == pair[1]]
        assert [r["dispatch_id"] for r in rows] == [dispatch_id], rows
        starts = [e for e in stack.events("job.started", book.book_id) if e["scene_id"] == pair[1]]
        assert len(starts) == 1, starts
        assert stack.asset_rows(book.book_id)[pair]["token"] == 1  # no re-dispatch: one token ever

    stack.check_artifacts(book.book_id, {p for p in stack.states(book.book_id) if p[2] == "image"})

    def duplicates() -> int:  # a worker writes its counts out within a second
        return int(coord.redis.client.hget(coord.redis.keys.metrics(), "job:duplicate_delivery:image") or 0)

    wait_for(lambda: duplicates() >= trials, 10, f"{trials} duplicate deliveries counted")
    metric = duplicates()
    assert metric == trials, metric
    figure(
        f"trials {trials}: job of {LONG_JOB['steps'] * LONG_JOB['step_seconds']:.0f}s, visibility timeout "
        f"{VISIBILITY}s on the sweeping worker; duplicate deliveries detected {len(detected)} (log + metric "
        f"job:duplicate_delivery={metric}), commits per pair 1 (artifact rows 1, job.ready 1, job.started 1), "
        f"lost 0, duplicated 0"
    )
