"""Issue 7, item 5, beyond tests/integration/test_client.py (a broker URL nobody listens on): the broker of a
running cluster goes away and comes back.

While the private redis-server (broker and coordination store) is stopped, `regenerate` from the Python
client and from the CLI fails fast with a clear error (`StoreUnavailable("broker", ...)`, CLI exit code 3);
the workers and beat survive the outage; started again on the same port (empty, as Redis restarts without
persistence), the same worker processes reconnect and a `regenerate` completes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from animastor_tasks.client import Client
from animastor_tasks.errors import StoreUnavailable
from tests.e2e.harness import audio_stage, image_stage, stage_table, wait_for
from tests.integration.helpers import make_book
from tests.support.cluster import REPO_ROOT
from tests.support.private_redis import PrivateRedis
from tests.support.tcp_proxy import TcpProxy

from .checks import unauthorized_dispatches

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

FAIL_FAST = 5.0  # seconds a regenerate may take to report the broker down (CLI: interpreter start included)


def test_broker_down_fails_fast_and_workers_reconnect(make_stack, redis_down_ok, figure, scale) -> None:
    stack = make_stack(stages=stage_table(audio=audio_stage(), image=image_stage()))
    cluster = stack.cluster
    procs = [cluster.control(wait=False), cluster.gpu("audio", wait=False), cluster.gpu("image", wait=False)]
    beat = cluster.beat(wait=False)
    cluster.wait_ready(*procs, beat)
    book = make_book("broker-outage", chapters=1, scenes=3)
    stack.rt.catalog.import_book(book)
    stack.client.regenerate(book.book_id, ["audio"])
    stack.wait_commands(book.book_id, ["audio"], "completed", timeout=20)

    redis_down_ok.stop()
    down = time.monotonic()

    client = Client(stack.settings, timeout=10)
    sent = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        client.regenerate(book.book_id, ["image"])
    client_took = time.monotonic() - sent
    client.close()
    assert info.value.store == "broker" and f"127.0.0.1:{redis_down_ok.port}" in str(info.value), info.value
    assert client_took < FAIL_FAST, f"the client took {client_took:.2f}s to report the broker down"

    sent = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "animastor_tasks.operator.cli", "regenerate", book.book_id, "--stage", "image"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={**os.environ, **stack.env},
    )
    cli_took = time.monotonic() - sent
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)
    assert "broker unavailable" in done.stderr and f"127.0.0.1:{redis_down_ok.port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert cli_took < FAIL_FAST, f"the CLI took {cli_took:.2f}s to exit"

    time.sleep(max(0.0, scale.pick(4.0, 15.0) - (time.monotonic() - down)))  # workers notice and retry
    outage = time.monotonic() - down
    for proc in [*procs, beat]:
        assert proc.alive(), f"{proc.name} died while the broker was down:\n{proc.tail()}"
    redis_down_ok.start()
    up = time.monotonic()

    # The same processes reconnect (a second "Connected to" line) and advertise their queues again.
    for proc in procs:
        wait_for(lambda p=proc: p.log().count("Connected to redis://") >= 2, 60, what=f"{proc.name} reconnected")
    wait_for(
        lambda: all(cluster.advertised(p) for p in procs[1:]), 30, interval=0.1, what="GPU workers advertised again"
    )
    reconnected = time.monotonic() - up
    sent = time.monotonic()
    answer = stack.client.regenerate(book.book_id, ["image"])
    assert [c["stage"] for c in answer["commands"]] == ["image"]
    stack.wait_commands(book.book_id, ["image"], "completed", timeout=30)
    completed = time.monotonic() - sent
    assert set(stack.states(book.book_id).values()) == {"ready"}
    stack.check_artifacts(book.book_id, stack.states(book.book_id))
    assert unauthorized_dispatches(stack) == []
    assert all(p.alive() for p in [*procs, beat]) and len(cluster.procs) == 4  # no process was restarted
    figure(
        f"broker down {outage:.1f}s: client refused in {client_took:.2f}s, CLI exit 3 in {cli_took:.2f}s; after the "
        f"broker came back the same 3 workers reconnected in {reconnected:.2f}s and a regenerate completed in "
        f"{completed:.2f}s; trials 1, lost 0, duplicated 0"
    )


def test_an_idle_worker_stays_advertised_while_only_its_broker_is_down(make_stack, tmp_path, figure) -> None:
    """A broker of its own (RabbitMQ, or a Redis that is not the coordination one) down longer than the presence
    TTL: Celery restarts the consumer, which stopped the presence step, and an idle worker withdrew its queues at
    once. The gate then saw no consumer of the stage and BLOCKED its commands, although the worker was alive and
    consumed again as soon as the broker was back. Presence is withdrawn when the worker shuts down, not when its
    connection restarts."""
    with PrivateRedis(tmp_path / "broker") as broker:
        stack = make_stack(broker_url=broker.url)
        seen = _advertised_through_an_outage(stack.cluster, broker.stop, broker.start, "Connected to redis://")
    figure(f"redis broker down 10s: the idle image worker advertised in all {len(seen)} reads (1 consumer each)")


def test_an_idle_worker_stays_advertised_while_its_rabbitmq_is_cut_off(make_stack, amqp_broker, figure) -> None:
    """The same with RabbitMQ, the broker production runs: its connections reset and refused (through a proxy,
    as the machine's RabbitMQ serves other runs) for three presence TTLs."""
    host, port = urlsplit(amqp_broker.url).hostname, urlsplit(amqp_broker.url).port
    with TcpProxy((host or "127.0.0.1", port or 5672)) as proxy:
        url = amqp_broker.url.replace(f"@{host}:{port}/", f"@127.0.0.1:{proxy.port}/")
        stack = make_stack(broker_url=url)
        seen = _advertised_through_an_outage(stack.cluster, proxy.cut, proxy.restore, "Connected to amqp://")
    figure(f"rabbitmq cut off 10s: the idle image worker advertised in all {len(seen)} reads (1 consumer each)")


def _advertised_through_an_outage(
    cluster: Any, cut: Callable[[], object], restore: Callable[[], object], connected: str
) -> list[int]:
    """Whether an idle GPU worker was advertised, read every 0.5 s through a 10 s broker outage (three presence
    TTLs); it must be in every read, and still after the worker reconnected."""
    worker = cluster.gpu("image")
    assert cluster.advertised(worker)
    cut()
    down = time.monotonic()
    wait_for(lambda: "Connection to broker lost" in worker.log() or "Cannot connect" in worker.log(), 30,
             what="the worker lost its broker")  # fmt: skip
    seen: list[int] = []
    while time.monotonic() - down < 10:
        seen.append(0 if cluster.advertised(worker) is None else 1)
        time.sleep(0.5)
    assert worker.alive() and min(seen) == 1, seen
    restore()
    wait_for(lambda: worker.log().count(connected) >= 2, 60, what="the worker reconnected")
    assert cluster.advertised(worker)
    return seen
