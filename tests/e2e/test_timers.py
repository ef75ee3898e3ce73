"""A prefork GPU worker lets go of each ended job's time-limit timer (worker/timers.py), on a real worker.

*Why:* a job that ended only marked its soft-limit timer cancelled; kombu kept it in the main process's event loop
until its due time (30 minutes by default), and the GPU worker's main process grew about 0.6 kB a job meanwhile.
The worker runs under a wrapper app that reads its own event loop: how many cancelled timers it holds, every
0.2 s, with the drop every 0.5 s instead of a minute.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from animastor_tasks.dev.celery_commands import celery_argv
from tests.integration.helpers import make_book
from tests.support import wait_for

from .harness import audio_stage, image_stage, stage_table

pytestmark = pytest.mark.e2e

PROBE = """
import os
from celery import signals
from animastor_tasks.worker import timers
timers.DROP_EVERY_SECONDS = 0.5
from animastor_tasks.worker.app import app  # noqa: E402,F401


@signals.worker_ready.connect
def probe(sender, **_):
    hub = sender.controller.hub

    def write():
        cancelled = sum(1 for item in hub.timer._queue if item.entry.canceled)
        with open(os.environ["PROBE_OUT"], "a") as out:
            out.write(f"{cancelled}\\n")

    hub.call_repeatedly(0.2, write)
"""


def test_a_gpu_worker_holds_no_timer_of_the_jobs_it_ended(make_stack, tmp_path: Path, figure) -> None:
    (tmp_path / "timer_probe.py").write_text(PROBE)
    out = tmp_path / "cancelled-timers"
    stack = make_stack(stages=stage_table(audio=audio_stage(lane_limit=8, book_quota=8, window=8), image=image_stage()))
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    argv = celery_argv("worker", "-Q", "gpu.audio", "-c", "1", "-n", "probed@%h", "-P", "prefork", app="timer_probe")
    stack.supervisor.start("probed", argv, {"PYTHONPATH": path, "PROBE_OUT": str(out)})
    stack.cluster.wait_ready(stack.cluster.control(wait=False))
    stack.wait_consumers("gpu.audio")
    book = make_book("timers", chapters=1, scenes=8)
    stack.rt.catalog.import_book(book)

    stack.client.regenerate(book.book_id, ["audio"])
    stack.wait_commands(book.book_id, ["audio"], "completed", timeout=60)
    ended = len(stack.events("job.ready", book.book_id))

    def counts() -> list[int]:
        return [int(line) for line in out.read_text().split()] if out.exists() else []

    written = len(counts())
    wait_for(lambda: len(counts()) >= written + 5, 10, what="the probe's counts")  # a second: two drops at least
    seen = counts()
    figure(f"{ended} jobs ended; cancelled timers held: at most {max(seen)}, at the end {seen[-1]}")
    assert ended == 8
    assert seen[-1] == 0, seen[-20:]
