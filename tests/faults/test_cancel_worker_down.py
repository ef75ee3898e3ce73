"""Issue 7, item 7: Stop All while the only worker of a stage is down, then start it again.

Jobs of the book are already queued on `gpu.image` when its only worker is SIGKILLed (one more was running
on it). The book is cancelled while no image worker runs, then a new one starts. Cancel's revoke broadcast
reached no image worker, and the new one starts with `--without-mingle`, so it does not learn the revoked
ids from the control worker either: the check at job start is all that stands between those messages and
the GPU. Pass criterion: every queued job is consumed and refused (`fence_rejected: cancelled` in the new
worker's log), and no `job.started` of the book has `at` after the cancel returned.

The presence TTL is longer than the test, so the dead worker still counts as a consumer and the stage is not
BLOCKED before the cancel (that path is tests/e2e/test_blocked.py); the lease TTL is long too, so the queued
jobs still hold current tokens and only the cancel can refuse them.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.e2e.harness import audio_stage, image_stage, running_dispatch, stage_table, wait_for
from tests.integration.helpers import make_book
from tests.support.cluster import Proc

from .checks import unauthorized_dispatches

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

SLOW = {"steps": 10, "step_seconds": 0.2}  # 2 s per image: the first one runs while the others wait queued


def refused(proc: Proc, dispatch_ids: set[str]) -> set[str]:
    """The dispatches the worker refused at start because their book was cancelled.

    The start refuses such a job on its own queued lease (the cancel released it) or, when it reads the
    lease first, on the cancel itself: either way before any GPU work.
    """
    reasons = ("fence_rejected: cancelled", "fence_rejected: lease lost before start")
    lines = [ln for ln in proc.log().splitlines() if any(reason in ln for reason in reasons)]
    return {i for i in dispatch_ids if any(f"dispatch={i}" in ln for ln in lines)}


def test_cancel_while_the_only_stage_worker_is_down_then_start_it(make_stack, figure, scale) -> None:
    trials = scale.pick(1, 3)
    stack = make_stack(
        stages=stage_table(audio=audio_stage(), image=image_stage(params=SLOW, lease_ttl=60)),
        presence_ttl_seconds=60,
    )
    cluster = stack.cluster
    broker = stack.rt.redis.client  # the private Redis: broker and coordination store are the same server
    image = cluster.gpu("image", wait=False, args=["--without-mingle"])
    cluster.wait_ready(cluster.control(wait=False), image, cluster.beat(wait=False))
    book = make_book("cancel-worker-down", chapters=1, scenes=6)
    stack.rt.catalog.import_book(book)

    queued_total, refused_total, drained = 0, 0, []
    for trial in range(trials):
        began = stack.db_now()
        stack.client.regenerate(book.book_id, ["image"])
        running = wait_for(lambda p=image: running_dispatch(p), 20, what="an image job running")
        wait_for(lambda: broker.llen("gpu.image") >= 3, 10, interval=0.02, what="image jobs queued behind it")
        cluster.kill(image, signal.SIGKILL)
        queued = int(broker.llen("gpu.image"))
        queued_ids = {
            e["dispatch_id"]
            for e in stack.events("dispatch", book.book_id)
            if e["at"] > began and e["dispatch_id"] != running
        } - {e["dispatch_id"] for e in stack.events("job.started", book.book_id)}
        assert len(queued_ids) == queued, (queued, queued_ids)

        answer = stack.client.cancel(book.book_id, reason=f"stop all, worker down (trial {trial})")
        cancelled_at = stack.db_now()
        assert answer["revoked"] == queued + 1, answer  # the queued jobs and the killed one
        assert not {"pending", "generating"} & set(stack.states(book.book_id).values())

        image = cluster.restart(image, wait=False)  # same options: --without-mingle
        restarted = time.monotonic()
        cluster.wait_ready(image)

        wait_for(lambda p=image, ids=queued_ids: refused(p, ids) == ids, 20, what="every queued job refused at start")
        drained.append(time.monotonic() - restarted)
        assert broker.llen("gpu.image") == 0
        time.sleep(stack.settings.tick_seconds * 2 + stack.settings.reconcile_seconds)  # nothing comes back
        late = [e for e in stack.events("job.started", book.book_id) if e["at"] > cancelled_at]
        assert late == [], f"trial {trial}: {len(late)} job(s) started after the cancel: {late}"
        assert [e for e in stack.events("dispatch", book.book_id) if e["at"] > cancelled_at] == []
        assert "Discarding revoked task" not in image.log(), "the revoke reached the new worker: fence not tested"
        assert {r.status for r in stack.commands(book.book_id).values()} == {"cancelled"}
        queued_total += queued
        refused_total += len(refused(image, queued_ids))

    assert unauthorized_dispatches(stack) == []
    started = stack.events("job.started", book.book_id)
    assert len(started) == trials, f"only the job running at each kill may have started: {started}"
    figure(
        f"trials {trials}: jobs queued on gpu.image when its only worker died {queued_total}, refused at start by "
        f"the new worker (fence_rejected: cancelled, no revoke known to it) {refused_total}, job starts after "
        f"the cancel 0; queue drained {max(drained):.2f}s after the restart (worker start included); "
        f"lost/duplicated n/a (book cancelled)"
    )
