"""A GPU host that alone cannot reach Postgres takes no job until it can (`flow.job.pause_while_unanswered`).

Its Postgres goes through a proxy that the test cuts; the other worker and the control plane reach Postgres
directly. On the old code the cut-off worker, idle while the healthy one ran the jobs its refills kept, took
every job published to the queue, failed its start check a pool timeout later (5 s) and took it again once the
tick had put it back: a reader's interactive scene went round so (15 deliveries in 90 s) and never started.
"""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.integration.helpers import make_book
from tests.support import wait_for
from tests.support.tcp_proxy import TcpProxy

from .harness import audio_stage, image_stage, stage_table

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

ONE_SECOND_JOBS = audio_stage(params={"steps": 4, "step_seconds": 0.25}, lane_limit=2, book_quota=2, lease_ttl=6)
PAUSE_AT_MOST = 60  # the breaker cool-down: past any wait here, so an early end is Postgres answering again
STARTS_WITHIN = 12.0  # a failed start (the pool's 5 s), the tick's takeover (1 s here), a healthy job's end


def _through(url: str, proxy: TcpProxy) -> str:
    where = urlsplit(url)
    return where._replace(netloc=f"{where.netloc.rsplit('@', 1)[0]}@127.0.0.1:{proxy.port}").geturl()


def test_a_host_cut_off_from_postgres_pauses_and_the_others_run_the_readers_scenes(
    make_stack: Any, figure: Any
) -> None:
    database = os.environ["ANIMASTOR_DATABASE_URL"]
    target = urlsplit(database)
    with TcpProxy((target.hostname or "127.0.0.1", target.port or 5432)) as proxy:
        stack = make_stack(
            stages=stage_table(audio=ONE_SECOND_JOBS, image=image_stage()), breaker_cooldown_seconds=PAUSE_AT_MOST
        )
        cluster = stack.cluster
        healthy = cluster.gpu("audio", wait=False)
        cut = cluster.gpu("audio", env={"ANIMASTOR_DATABASE_URL": _through(database, proxy)}, wait=False)
        cluster.wait_ready(cluster.control(wait=False), cluster.beat(wait=False), healthy, cut, timeout=60)
        bulk, reader = make_book("bulk", chapters=1, scenes=80), make_book("reader", chapters=1, scenes=2)
        stack.rt.catalog.import_book(bulk)
        stack.rt.catalog.import_book(reader)
        proxy.cut()
        stack.client.regenerate(bulk.book_id, ["audio"], wait=False, priority="bulk")
        cut.wait_log("error connecting in", timeout=30)  # a start check of it, unanswered

        waits = []
        for scene in ("s1", "s2"):
            sent = time.monotonic()
            stack.client.regenerate(reader.book_id, ["audio"], [("ch1", scene)], wait=False, priority="interactive")
            wait_for(
                lambda scene=scene: (
                    [e for e in stack.events("job.started", reader.book_id) if e["scene_id"] == scene] or None
                ),
                30,
                what=f"the reader's {scene} started",
            )
            waits.append(time.monotonic() - sent)
        assert max(waits) < STARTS_WITHIN, waits
        assert " started on " not in cut.log()
        cut.wait_log("Postgres did not answer a start check of gpu.audio", timeout=30)

        proxy.restore()
        restored = time.monotonic()
        cut.wait_log(" started on ", timeout=30)  # its pause ended as Postgres answered, not after the cool-down
        back = time.monotonic() - restored
        assert back < PAUSE_AT_MOST / 2, back
        paused = stack.rt.redis.client.hget(stack.rt.redis.keys.metrics(), "job:store_paused:audio")
        assert int(paused or 0) >= 1
    figure(
        f"interactive starts {[round(w, 1) for w in waits]}s while a host could not reach Postgres;"
        f" it ran jobs again {back:.1f}s after Postgres answered it"
    )
