"""RabbitMQ: a GPU worker whose processes are all busy takes no job after its broker connection comes back.

Why: a running job's message is on the channel that died with the connection, so it no longer counts against
the new channel's prefetch, and Celery reconnects with a prefetch of at least one. A worker whose only process
ran a long job took one more job it could not start until that job ended, while another worker of the queue
sat idle; the job waited there, its pair `generating`, for most of the long job (hours in production).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from typing import Any

import pytest

from tests.support import missing, wait_for

from .harness import audio_stage, running_dispatch, stage_table

pytestmark = [pytest.mark.e2e, pytest.mark.amqp]

JOB_SECONDS = 40.0
START_BOUND = 6.0  # seconds from the regenerate to both jobs started on the idle worker


def _close_connections(ctl: str, vhost: str, pid: int) -> int:
    """Close, on the broker's side, every AMQP connection of process `pid` (found by its local ports)."""
    import psutil

    ports = {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.raddr and c.raddr.port == 5672}
    listed = subprocess.run(
        [ctl, "-q", "list_connections", "-p", vhost, "pid", "peer_port"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    closed = 0
    for line in listed.splitlines():
        fields = line.split("\t")
        if len(fields) == 2 and fields[1].strip().isdigit() and int(fields[1]) in ports:
            subprocess.run([ctl, "close_connection", fields[0], "e2e: lost"], capture_output=True, timeout=30)
            closed += 1
    return closed


def _consumers(url: str, queue: str) -> int:
    from kombu import Connection

    with Connection(url, connect_timeout=3) as conn:
        channel = conn.channel()
        try:
            return int(channel.queue_declare(queue=queue, passive=True)[2])
        finally:
            channel.close()


def _started(log: str, book: str) -> int:
    return sum(1 for line in log.splitlines() if " started on " in line and f"book={book!r}" in line)


def _pong(cluster: Any, proc: Any) -> bool:
    answer = cluster.run(["inspect", "ping", "-d", proc.hostname, "--timeout", "2"], timeout=30)
    return "pong" in answer.stdout


def _received(log: str) -> list[str]:
    return re.findall(r"animastor\.generate\.audio\[([^\]]+)\] received", log)


def test_a_busy_gpu_worker_takes_no_job_after_its_broker_connection_comes_back(
    make_stack: Any, figure: Any, amqp_broker: Any
) -> None:
    from tests.integration.helpers import make_book

    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        missing("rabbitmqctl is not installed")
    job = {"steps": int(JOB_SECONDS / 0.5), "step_seconds": 0.5}
    stack = make_stack(broker_url=amqp_broker.url, stages=stage_table(audio=audio_stage(params=job)))
    cluster = stack.cluster
    control, busy = cluster.control(wait=False), cluster.gpu("audio", wait=False)
    cluster.wait_ready(control, busy)
    long_book = make_book("long-job", chapters=1, scenes=1)
    stack.rt.catalog.import_book(long_book)
    stack.client.regenerate(long_book.book_id, ["audio"])
    busy.wait_log(" started on ", timeout=30)
    long_job = running_dispatch(busy)
    idle = cluster.gpu("audio", concurrency=2)  # two processes: both new jobs can start there at once

    connects = busy.log().count("Connected to amqp://")
    assert _close_connections(ctl, amqp_broker.vhost, busy.pid) >= 1
    wait_for(lambda: busy.log().count("Connected to amqp://") > connects, 30, what="the busy worker reconnected")
    # Its event loop answers remote control only once every consumer step has started again.
    wait_for(lambda: _pong(cluster, busy), 30, interval=0.5, what="the busy worker's event loop back")
    # The long job's message went back to its queue with the connection: the idle worker finds it running.
    wait_for(lambda: "duplicate delivery" in idle.log(), 30, what="the long job's copy refused by the idle worker")
    taken = _received(busy.log())
    assert running_dispatch(busy) == long_job, "the long job ended before the test could queue the next ones"

    book = make_book("after-reconnect", chapters=1, scenes=2)
    stack.rt.catalog.import_book(book)
    sent = time.monotonic()
    stack.client.regenerate(book.book_id, ["audio"])
    while _started(idle.log(), book.book_id) < 2 and time.monotonic() - sent < START_BOUND:
        time.sleep(0.1)
    started = time.monotonic() - sent
    assert _received(busy.log())[len(taken) :] == [], "the busy worker took a job it could not start"
    assert _started(idle.log(), book.book_id) == 2, f"both jobs not started on the idle worker in {START_BOUND}s"
    reserved = cluster.run(["inspect", "reserved", "-d", busy.hostname or "", "--timeout", "5"], timeout=30)
    assert "empty" in reserved.stdout, reserved.stdout + reserved.stderr
    assert cluster.advertised(busy) == busy.hostname  # still a live worker of the stage, not BLOCKED
    assert _consumers(amqp_broker.url, "gpu.audio") == 1  # only the idle worker's consumer

    # Once its job ends the busy worker consumes again.
    wait_for(lambda: running_dispatch(busy) is None, JOB_SECONDS + 10, what="the long job ended")
    ended = time.monotonic()
    wait_for(lambda: _consumers(amqp_broker.url, "gpu.audio") == 2, 5, what="the busy worker consumes again")
    figure(
        f"amqp reconnect with every process busy: both new jobs started on the idle worker {started:.1f}s after the"
        f" regenerate, the busy worker took none; it consumed again {time.monotonic() - ended:.1f}s after its job"
    )
