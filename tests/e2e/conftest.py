"""End-to-end fixtures: private coordination stores and a `Stack` of real Celery processes.

The tests run their workers against a redis-server of their own (started here, on a
free port) rather than the shared test Redis db: other test runs on this machine flush
that db and look at its broker lists, and real workers consuming `gpu.audio` there would
interfere both ways. Postgres is the per-run database that `tests/conftest.py` made.
RabbitMQ tests get a vhost of their own when `rabbitmqctl` can make one (else `/`,
purged before and after).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support import Figures, missing
from tests.support.private_redis import PrivateRedis
from tests.support.stack import Stack

from .harness import audio_stage, image_stage, stage_table

FIGURES = Figures()
E2E_TABLES = "events, artifacts, cancel_tombstones, command_targets, commands, asset_states, scenes, chapters, books"
GPU_QUEUES = ("gpu.audio", "gpu.image")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    FIGURES.summarize(terminalreporter, "e2e figures")


@pytest.fixture
def figure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record a measured figure: printed now and in the terminal summary."""
    return FIGURES.recorder(request)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    """The session's private redis-server; a test that stops it must start it again (see tests/faults)."""
    with PrivateRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def private_redis(redis_server: PrivateRedis) -> str:
    return redis_server.url


def _amqp_reachable() -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", 5672), timeout=1):
        return True
    return False


@dataclass(frozen=True)
class AmqpBroker:
    url: str
    vhost: str
    private: bool  # a vhost of our own (deleted at the end); else the shared "/"


@pytest.fixture(scope="session")
def amqp_broker() -> Iterator[AmqpBroker]:
    if not _amqp_reachable():
        missing("RabbitMQ is not listening on 127.0.0.1:5672")
    vhost = f"animastor-e2e-{uuid.uuid4().hex[:8]}"
    ctl = shutil.which("rabbitmqctl")
    made = False
    if ctl:
        made = (
            subprocess.run([ctl, "add_vhost", vhost], capture_output=True, timeout=30).returncode == 0
            and subprocess.run(
                [ctl, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"], capture_output=True, timeout=30
            ).returncode
            == 0
        )
    if made:
        yield AmqpBroker(f"amqp://guest:guest@127.0.0.1:5672/{vhost}", vhost, True)
        subprocess.run([ctl or "rabbitmqctl", "delete_vhost", vhost], capture_output=True, timeout=30)
    else:
        yield AmqpBroker("amqp://guest:guest@127.0.0.1:5672//", "/", False)


def purge_amqp(url: str) -> None:
    from kombu import Connection

    with Connection(url, connect_timeout=3) as conn:
        for queue in (*GPU_QUEUES, "animastor.control"):
            channel = conn.channel()
            try:
                channel.queue_purge(queue)
            except Exception:  # a queue that does not exist yet closes the channel
                pass
            finally:
                with contextlib.suppress(Exception):
                    channel.close()


@pytest.fixture
def make_stack(
    request: pytest.FixtureRequest, migrated: Any, private_redis: str, tmp_path: Path
) -> Iterator[Callable[..., Stack]]:
    """Build the stack for one test: clean stores, env, observer runtime, client, cluster.

    `make_stack(stages=..., broker_url=..., **ANIMASTOR_overrides)`; the stack is
    always closed at teardown, and the logs' tails are printed when the test failed.
    """
    stacks: list[Stack] = []

    def build(*, stages: str | None = None, broker_url: str | None = None, **overrides: Any) -> Stack:
        with migrated.transaction() as conn:
            conn.execute(f"TRUNCATE {E2E_TABLES} RESTART IDENTITY CASCADE")
        client = redis.Redis.from_url(private_redis)
        client.flushall()
        client.close()
        if broker_url and broker_url.startswith("amqp"):
            purge_amqp(broker_url)
        artifacts = tmp_path / "artifacts"
        artifacts.mkdir(exist_ok=True)
        env = {
            "ANIMASTOR_DATABASE_URL": os.environ["ANIMASTOR_DATABASE_URL"],
            "ANIMASTOR_KEY_PREFIX": os.environ.get("ANIMASTOR_KEY_PREFIX", "e2e"),
            "ANIMASTOR_REDIS_URL": private_redis,
            "ANIMASTOR_BROKER_URL": broker_url or private_redis,
            "ANIMASTOR_ARTIFACT_ROOT": str(artifacts),
            "ANIMASTOR_TICK_SECONDS": "1",
            "ANIMASTOR_RECONCILE_SECONDS": "2",
            "ANIMASTOR_PRESENCE_TTL_SECONDS": "3",
            "ANIMASTOR_STAGES": stages or stage_table(audio=audio_stage(), image=image_stage()),
        }
        env.update({f"ANIMASTOR_{k.upper()}": str(v) for k, v in overrides.items()})
        stack = Stack(env, tmp_path / f"stack{len(stacks)}")
        stacks.append(stack)
        return stack

    yield build

    failed = any(
        getattr(request.node, f"rep_{w}", None) and getattr(request.node, f"rep_{w}").failed for w in ("setup", "call")
    )
    for stack in stacks:
        if failed:
            print(f"\n===== process logs ({request.node.name}) =====\n{stack.cluster.report(lines=60)}")
        stack.close()
        if stack.env["ANIMASTOR_BROKER_URL"].startswith("amqp"):
            with contextlib.suppress(Exception):
                purge_amqp(stack.env["ANIMASTOR_BROKER_URL"])
