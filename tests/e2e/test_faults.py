"""Workers dying and freezing mid-job: leases expire, reconcile re-queues, fencing refuses stale commits."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.integration.helpers import make_book

from .harness import (
    GeneratingMonitor,
    audio_stage,
    generate_lines,
    image_stage,
    running_dispatch,
    stage_table,
    wait_for,
)

pytestmark = pytest.mark.e2e


def test_sigkill_image_worker_mid_job_five_times(make_stack, figure) -> None:
    job = {"steps": 4, "step_seconds": 0.25}  # 1 s per image
    lease_ttl = 3
    # One job in flight at a time (lane 1, quota 1): every kill hits the only running job and
    # nothing waits queued long enough to lose its lease. The presence TTL outlasts a restart,
    # so the queue never looks consumerless (that would rightly BLOCK the command).
    stages = stage_table(
        audio=audio_stage(),
        image=image_stage(params=job, lease_ttl=lease_ttl, lane_limit=1, book_quota=1),
    )
    stack = make_stack(stages=stages, presence_ttl_seconds=10)
    cluster, settings = stack.cluster, stack.settings
    image = cluster.gpu("image", wait=False)
    cluster.wait_ready(cluster.control(wait=False), image, cluster.beat(wait=False))
    book = make_book("kill-book", chapters=2, scenes=5)
    stack.rt.catalog.import_book(book)
    pairs = {pair for pair in stack.states(book.book_id) if pair[2] == "image"}
    assert len(pairs) == 10

    monitor = GeneratingMonitor(stack, book.book_id)
    began = time.monotonic()
    try:
        stack.client.regenerate(book.book_id, ["image"])
        kills: list[tuple[str, tuple[tuple[str, str, str], int], float]] = []
        while len(kills) < 5:
            dispatch_id = wait_for(lambda p=image: running_dispatch(p), 30, what="a job running on the image worker")
            time.sleep(0.3)
            assets = stack.asset_rows(book.book_id)
            holder = [(pair, a["token"]) for pair, a in assets.items() if a["dispatch_id"] == dispatch_id]
            if running_dispatch(image) != dispatch_id or not holder or assets[holder[0][0]]["state"] != "generating":
                continue  # it finished meanwhile; kill the next one
            cluster.kill(image, signal.SIGKILL)
            kills.append((dispatch_id, holder[0], time.monotonic()))
            image = cluster.restart(image, wait=False)
        cluster.wait_ready(image)
        rows = stack.wait_commands(book.book_id, ["image"], "completed", timeout=90)
    finally:
        monitor.stop()
    elapsed = time.monotonic() - began

    assert monitor.errors == []
    assert rows["image"].progress["ready"] == 10
    states = stack.states(book.book_id)
    assert {s for (_, _, st), s in states.items() if st == "image"} == {"ready"}
    artifacts = stack.check_artifacts(book.book_id, pairs)  # one row per pair, under its final token
    killed_ids = {d for d, _, _ in kills}
    assert not killed_ids & {r["dispatch_id"] for r in artifacts}
    assert not killed_ids & {e["dispatch_id"] for e in stack.events("job.ready", book.book_id)}

    # A killed job's pair leaves `generating` within lease TTL + one reconcile (+1 s for polling/tick jitter).
    bound = lease_ttl + settings.reconcile_seconds + 1.0
    recoveries = []
    for dispatch_id, key, killed_at in kills:
        assert key in monitor.ended, f"{key} (dispatch {dispatch_id}) still generating"
        recoveries.append(monitor.ended[key] - killed_at)
    assert max(recoveries) <= bound, f"recoveries {recoveries} exceed {bound}s"
    # And no pair ever stayed `generating` longer than a job plus that bound.
    longest, which = monitor.longest()
    assert longest <= bound + 1.0 + 0.5, f"{which} generating for {longest:.1f}s"
    expired = stack.events("lease.expired", book.book_id)
    assert len(expired) >= 5
    jobs = len(stack.events("job.started", book.book_id))
    figure(
        f"kills {len(kills)}, jobs started {jobs}, dispatches {len(stack.events('dispatch', book.book_id))}, "
        f"leases expired {len(expired)}, total {elapsed:.1f}s; kill -> pair released max {max(recoveries):.2f}s "
        f"(bound {bound:.0f}s); longest generating {longest:.2f}s"
    )


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
