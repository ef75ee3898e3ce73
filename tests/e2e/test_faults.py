"""Workers dying and freezing mid-job: leases expire, reconcile re-queues, fencing refuses stale commits."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.integration.helpers import make_book

from .harness import (
    audio_stage,
    generate_lines,
    image_stage,
    running_dispatch,
    sigkill_trials,
    stage_table,
    wait_for,
)

pytestmark = pytest.mark.e2e


def test_sigkill_image_worker_mid_job_five_times(make_stack, figure) -> None:
    # 10 one-second jobs on one image worker; tests/faults runs the same scenario with more kills and jobs.
    sigkill_trials(make_stack, figure, kills=5, chapters=2, scenes=5, job={"steps": 4, "step_seconds": 0.25})


def test_sigstopped_worker_loses_lease_and_its_late_result_is_refused(make_stack, figure) -> None:
    job = {"steps": 6, "step_seconds": 0.5}  # 3 s
    lease_ttl = 3
    stack = make_stack(stages=stage_table(audio=audio_stage(), image=image_stage(params=job, lease_ttl=lease_ttl)))
    cluster, settings = stack.cluster, stack.settings
    first, second = cluster.gpu("image", wait=False), cluster.gpu("image", wait=False)
    cluster.wait_ready(cluster.control(wait=False), first, second, cluster.beat(wait=False))
    book = make_book("fence-book", chapters=1, scenes=1)
    stack.rt.catalog.import_book(book)
    pair = ("ch1", "s1", "image")

    stack.client.regenerate(book.book_id, ["image"], [("ch1", "s1")])
    started = wait_for(lambda: stack.events("job.started", book.book_id), 15, what="job started")
    stale_id = started[0]["dispatch_id"]
    holder = wait_for(lambda: next((p for p in (first, second) if running_dispatch(p) == stale_id), None), 5)
    other = second if holder is first else first
    time.sleep(0.5)
    cluster.send_signal(holder, signal.SIGSTOP)
    frozen = time.monotonic()

    # The lease lapses, reconcile re-queues the pair and the other worker completes it under a new token.
    def ready_again() -> dict | None:
        asset = stack.asset_rows(book.book_id)[pair]
        return asset if asset["state"] == "ready" else None

    try:
        asset = wait_for(ready_again, timeout=lease_ttl + settings.reconcile_seconds + 10, what="pair ready again")
        recovered = time.monotonic() - frozen
        assert asset["token"] == 2 and asset["dispatch_id"] != stale_id
        assert any(" started on " in line for line in generate_lines(other, asset["dispatch_id"]))
        # The frozen worker stopped heartbeating: its presence lapsed within one TTL.
        wait_for(lambda: cluster.advertised(holder) is None, settings.presence_ttl_seconds, what="frozen presence")
    finally:
        cluster.send_signal(holder, signal.SIGCONT)
    thawed = time.monotonic()

    # The thawed job finds its lease gone (watcher) or its token stale (commit CAS): nothing is committed.
    result = wait_for(lambda: [ln for ln in generate_lines(holder, stale_id) if "succeeded in" in ln], 15)
    outcome = re.search(r"'outcome': '(\w+)'", result[0]).group(1)
    lines = generate_lines(holder, stale_id)
    assert outcome in ("fence_rejected", "stopped"), result
    assert any("fence_rejected" in line or "stopping: lease lost" in line for line in lines), lines
    time.sleep(1.0)
    final = stack.asset_rows(book.book_id)[pair]
    assert final == asset, (final, asset)
    stack.check_artifacts(book.book_id, [pair])
    assert stack.query("SELECT count(*) FROM artifacts WHERE book_id = %s", (book.book_id,))[0][0] == 1
    assert [e["dispatch_id"] for e in stack.events("job.ready", book.book_id)] == [asset["dispatch_id"]]
    assert [e["detail"]["token"] for e in stack.events("lease.expired", book.book_id)] == [1]
    assert stack.commands(book.book_id)["image"].status == "completed"
    figure(
        f"SIGSTOP -> pair ready again under token 2 in {recovered:.2f}s (lease {lease_ttl}s, reconcile "
        f"{settings.reconcile_seconds:.0f}s); thawed job outcome {outcome!r} "
        f"({time.monotonic() - thawed:.2f}s after SIGCONT incl. 1 s settle); artifacts 1"
    )
