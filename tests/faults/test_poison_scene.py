"""Issue "Correct under real workloads", item 3: a poison scene cannot loop.

A scene whose job kills its worker process (CUDA OOM, a segfault, the OOM killer) used to be redelivered
(`acks_late` + `reject_on_worker_lost`), or sent back to `pending` by reconcile once its lease lapsed, and
dispatched again, forever. Here a real GPU worker's pool child is SIGKILLed every time the chosen scene's
job starts (seen in the journal's `job.started`). After ANIMASTOR_WORKER_LOST_LIMIT worker-lost starts the
pair fails with `worker_lost: N starts` without GPU work, the book's other scenes finish, and the pair is
never started again.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.harness import audio_stage, image_stage, stage_table
from tests.integration.helpers import make_book
from tests.support import wait_for
from tests.support.cluster import pool_children

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.timeout(180)]

LIMIT = 3
POISON = ("ch1", "s2", "audio")


def test_a_scene_that_kills_its_worker_fails_after_the_limit_and_never_loops(make_stack, figure) -> None:
    job = {"steps": 10, "step_seconds": 0.2}  # 2 s per job: the kill lands well inside it
    stack = make_stack(
        stages=stage_table(audio=audio_stage(params=job, lease_ttl=3), image=image_stage()),
        worker_lost_limit=LIMIT,
        presence_ttl_seconds=10,  # the worker's main process lives on; a pool child's death never BLOCKs
    )
    cluster = stack.cluster
    gpu = cluster.gpu("audio", wait=False)
    cluster.wait_ready(cluster.control(wait=False), gpu, cluster.beat(wait=False))
    book = make_book("poison-book", chapters=1, scenes=4)
    stack.rt.catalog.import_book(book)
    audio = {pair for pair in stack.states(book.book_id) if pair[2] == "audio"}

    def poison_starts() -> list[tuple[int, str]]:
        return [
            (int(i), str(d))
            for i, d in stack.query(
                "SELECT id, dispatch_id FROM events WHERE kind = 'job.started' AND book_id = %s"
                " AND chapter_id = %s AND scene_id = %s AND stage = %s ORDER BY id",
                (book.book_id, *POISON),
            )
        ]

    def poison_state() -> tuple[str, str | None]:
        [(state, error)] = stack.query(
            "SELECT state, error FROM asset_states WHERE book_id = %s AND chapter_id = %s AND scene_id = %s"
            " AND stage = %s",
            (book.book_id, *POISON),
        )
        return str(state), error

    began = time.monotonic()
    stack.client.regenerate(book.book_id, ["audio"])
    killed: list[tuple[str, int]] = []
    deadline = time.monotonic() + 120
    while poison_state()[0] != "failed":
        assert time.monotonic() < deadline, f"poison pair never failed; killed {killed}\n{cluster.report()}"
        for _, dispatch_id in poison_starts()[len(killed) :]:
            children = wait_for(lambda: pool_children(gpu.pid) or None, 10, interval=0.02, what="a pool child")
            for pid in children:  # -c 1: the one pool child, running the poison job now
                os.kill(pid, signal.SIGKILL)
            killed.append((dispatch_id, children[0]))
        time.sleep(0.02)
    failed_after = time.monotonic() - began

    rows = stack.wait_commands(book.book_id, ["audio"], "failed", timeout=60)
    state, error = poison_state()
    assert (state, error) == ("failed", f"worker_lost: {LIMIT} starts")
    states = stack.states(book.book_id)
    assert {p: states[p] for p in audio - {POISON}} == dict.fromkeys(audio - {POISON}, "ready")
    assert rows["audio"].reason == "1 of 4 targets failed"
    assert gpu.alive(), "the worker's main process survives its pool children"

    # No further start: two more reconcile passes and ticks change nothing.
    dispatches = len(
        [e for e in stack.events("dispatch", book.book_id) if (e["chapter_id"], e["scene_id"]) == POISON[:2]]
    )
    quiet = 2 * stack.settings.reconcile_seconds + 1
    time.sleep(quiet)
    starts = poison_starts()
    assert len(starts) == LIMIT == len(killed), (starts, killed)
    assert poison_state() == (state, error)
    after = len([e for e in stack.events("dispatch", book.book_id) if (e["chapter_id"], e["scene_id"]) == POISON[:2]])
    assert after == dispatches
    lost = [
        e["detail"].get("lost_starts") for e in stack.events("job.started", book.book_id) if e["scene_id"] == POISON[1]
    ]
    assert lost == list(range(LIMIT)), lost
    duplicates = len(cluster.logs_mentioning("duplicate delivery"))
    figure(
        f"poison pair: {len(starts)} starts, {len(killed)} pool children SIGKILLed, {dispatches} dispatches, "
        f"{duplicates} redeliveries refused as duplicate; failed '{error}' {failed_after:.1f}s after the regenerate; "
        f"other pairs ready {len(audio) - 1}/{len(audio) - 1}; no start in the {quiet:.0f}s after"
    )
