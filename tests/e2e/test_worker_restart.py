"""A GPU worker says it will consume its queues from the start of its blueprint, before its consumer can
(`worker/presence.py` `StartingPresenceStep`), so a stage is not BLOCKED while its worker starts.

The consumer is held back here by an honest means: the worker's broker, through a proxy, refuses connections for
the first seconds (as a slow start would: a model load, a broker restarting beside it). Before, a worker's first
heartbeat came from its consumer:

- a stage's only worker killed whole mid-job (the OOM killer, a crash) and started again under its node name, as
  the shipped systemd unit does: the killed run's heartbeat lapsed before the successor consumed, and the tick
  BLOCKED the command (`no_worker:audio`) for good, its pair left dirty;
- on RabbitMQ, which counts no consumer on the queue while the worker starts: a command sent then was BLOCKED
  unless the heartbeat says the worker holds the queue (`PresenceStore.counts`).
"""

from __future__ import annotations

import threading
import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.integration.helpers import make_book
from tests.support import wait_for
from tests.support.tcp_proxy import TcpProxy

from .harness import audio_stage, image_stage, stage_table

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

TTL = 9.0  # presence TTL: a killed run's heartbeat lapses 6-9 s after the kill
RESTART_DELAY = 1.0  # deploy/systemd/animastor-gpu-worker@.service's RestartSec
# The successor's broker refuses it this long after the kill: past the lapse, the second count a heartbeat later
# (TTL/3 + 0.5 s) and two ticks (1 s each here).
BROKER_DOWN = TTL + TTL / 3 + 0.5 + 2.0 + 1.0
SLOW_AUDIO = audio_stage(params={"steps": 20, "step_seconds": 0.2}, lease_ttl=60)  # a 4 s job


class CommandWatch:
    """Every status the book's audio command had, read every 0.1 s (a BLOCKED one never comes back); stopped when
    its `with` ends, so it reads no store the test's teardown removes."""

    def __init__(self, stack: Any, book: str) -> None:
        self.stack, self.book = stack, book
        self.seen: list[tuple[str, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="command-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            row = self.stack.commands(self.book).get("audio")
            if row is not None and (not self.seen or self.seen[-1] != (row.status, row.reason)):
                self.seen.append((row.status, row.reason))
            self._stop.wait(0.1)

    def stop(self) -> list[tuple[str, str | None]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.seen

    def __enter__(self) -> CommandWatch:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def _through(url: str, proxy: TcpProxy) -> str:
    where = urlsplit(url)
    return where._replace(
        netloc=where.netloc.replace(f"{where.hostname}:{where.port}", f"127.0.0.1:{proxy.port}")
    ).geturl()


def _ready_or_blocked(stack: Any, book: str, watch: CommandWatch) -> bool:
    return stack.states(book)[("ch1", "s1", "audio")] == "ready" or (
        bool(watch.seen) and watch.seen[-1][0] == "blocked"
    )


def test_a_stage_whose_only_worker_is_killed_and_restarted_is_not_blocked_while_it_starts(
    make_stack: Any, private_redis: str, figure: Any
) -> None:
    target = urlsplit(private_redis)
    with TcpProxy((target.hostname or "127.0.0.1", target.port or 6379)) as proxy:
        stack = make_stack(stages=stage_table(audio=SLOW_AUDIO, image=image_stage()), presence_ttl_seconds=TTL)
        cluster = stack.cluster
        gpu_env = {"ANIMASTOR_BROKER_URL": _through(private_redis, proxy)}
        gpu = cluster.gpu("audio", env=gpu_env, wait=False)
        cluster.wait_ready(cluster.control(wait=False), cluster.beat(wait=False), gpu, timeout=60)
        book = make_book("restart", chapters=1, scenes=1)
        stack.rt.catalog.import_book(book)

        with CommandWatch(stack, book.book_id) as watch:
            stack.client.regenerate(book.book_id, ["audio"], wait=False)
            wait_for(lambda: stack.events("job.started", book.book_id) or None, 30, what="the job started")
            time.sleep(0.5)  # inside its 4 s run
            cluster.kill(gpu)  # SIGKILL to the whole process group
            killed = time.monotonic()
            proxy.cut()
            time.sleep(RESTART_DELAY)
            successor = cluster.gpu("audio", env=gpu_env, args=["-n", gpu.hostname or ""], wait=False)
            time.sleep(max(0.0, killed + BROKER_DOWN - time.monotonic()))
            assert successor.alive(), successor.tail()
            assert " ready." not in successor.log(), "its consumer started before the killed run's heartbeat lapsed"
            during = list(watch.seen)
            proxy.restore()
            successor.wait_log(" ready.", timeout=30)
            wait_for(lambda: _ready_or_blocked(stack, book.book_id, watch), 40, what="the pair ready again")
        took = time.monotonic() - killed
        assert ("blocked", "no_worker:audio") not in during, during
        assert [status for status, _ in watch.seen if status == "blocked"] == [], watch.seen
        assert stack.states(book.book_id)[("ch1", "s1", "audio")] == "ready"
        stack.wait_commands(book.book_id, ["audio"], "completed", timeout=10)
        assert cluster.stop(successor) == 0, successor.tail()  # while its broker is reachable
    figure(
        f"killed, restarted after {RESTART_DELAY:.0f}s, consumer held back {BROKER_DOWN:.1f}s (TTL {TTL:.0f}s): "
        f"command statuses {[s for s, _ in watch.seen]}, pair ready {took:.1f}s after the kill"
    )


def test_on_rabbitmq_a_command_sent_while_the_stage_s_worker_starts_waits_for_it(
    make_stack: Any, amqp_broker: Any, figure: Any
) -> None:
    """RabbitMQ counts no consumer on the queue until the worker's consumer starts; the worker's heartbeat holds the
    queue meanwhile, so the command is dispatched and runs once the consumer is up."""
    target = urlsplit(amqp_broker.url)
    with TcpProxy((target.hostname or "127.0.0.1", target.port or 5672)) as proxy:
        stack = make_stack(stages=stage_table(audio=SLOW_AUDIO, image=image_stage()), broker_url=amqp_broker.url)
        cluster = stack.cluster
        cluster.wait_ready(cluster.control(wait=False), cluster.beat(wait=False), timeout=60)
        book = make_book("starting", chapters=1, scenes=1)
        stack.rt.catalog.import_book(book)
        proxy.cut()
        gpu = cluster.gpu("audio", env={"ANIMASTOR_BROKER_URL": _through(amqp_broker.url, proxy)}, wait=False)
        gpu.wait_log("Cannot connect to amqp://", timeout=60)

        with CommandWatch(stack, book.book_id) as watch:
            sent = time.monotonic()
            stack.client.regenerate(book.book_id, ["audio"], wait=False)
            ttl = stack.settings.presence_ttl_seconds
            time.sleep(ttl + ttl / 3 + 0.5 + 2.0)  # past a TTL, and a tick's count and its second count
            assert " ready." not in gpu.log(), "the consumer started while the broker refused it"
            during = list(watch.seen)
            proxy.restore()
            wait_for(lambda: _ready_or_blocked(stack, book.book_id, watch), 40, what="the pair ready")
        took = time.monotonic() - sent
        assert ("blocked", "no_worker:audio") not in during, during
        assert [status for status, _ in watch.seen if status == "blocked"] == [], watch.seen
        stack.wait_commands(book.book_id, ["audio"], "completed", timeout=10)
        assert cluster.stop(gpu) == 0, gpu.tail()
    figure(f"rabbitmq: command statuses {[s for s, _ in watch.seen]} while the worker started; ready {took:.1f}s on")


def test_a_worker_refused_at_start_advertises_nothing(make_stack: Any, tmp_path: Any) -> None:
    """The start checks (exit 2: a setting to fix, not restarted) come before the worker's first beat: a refused
    worker holds no queue, so its stage blocks as it would without it."""
    stack = make_stack()
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    done = stack.cluster.run(
        ["worker", "-Q", "gpu.audio", "-c", "1", "-n", "refused@%h", "-l", "info"],
        env={"ANIMASTOR_ARTIFACT_ROOT": str(not_a_directory / "artifacts")},
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "refusing to start" in done.stderr, done.stderr
    client, keys = stack.rt.redis.client, stack.rt.redis.keys
    assert client.zcard(keys.consumers("gpu.audio")) == 0
    assert client.zcard(keys.held("gpu.audio")) == 0
    assert stack.rt.presence.nodes() == []
