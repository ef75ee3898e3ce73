"""Fixtures of the `cluster` suite: hosts in network namespaces, the control host's own stores, both brokers.

The network and the control host's servers (PostgreSQL, Redis, RabbitMQ, the S3 server) are started once per
session (RabbitMQ's boot is the slowest part); each test gets clean stores (tables truncated, Redis flushed, a
RabbitMQ vhost of its own) and starts its own workers and beat on the hosts. Everything a test starts is
stopped when it ends, also when it fails; the network goes at the end of the session, and a session first
removes what a crashed earlier run left behind (namespaces and links named `anb<id>-…` of a dead owner).
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tests.support import missing
from tests.support.netns import Network, sweep_leftovers, unavailable
from tests.support.netns_cluster import ManyHosts
from tests.support.netns_services import ControlServices, missing_tools

TABLES = "events, artifacts, cancel_tombstones, command_targets, commands, asset_states, scenes, chapters, books"
GPU_HOSTS = ("gpu1", "gpu2")
BROKERS = ("redis", "amqp")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def network() -> Iterator[Network]:
    """The control host `ctl` and the GPU hosts `gpu1`, `gpu2` on a bridge of their own."""
    reason = unavailable()
    if reason is not None:
        missing(reason)
    lacks = missing_tools()
    if lacks:
        missing("the control host needs " + ", ".join(lacks))
    sweep_leftovers()
    # SIGTERM (a CI timeout, `timeout(1)`) unwinds like Ctrl-C while the network exists, so the fixtures still
    # remove namespaces, links and processes; SIGKILL cannot, and the next session's sweep does it then.
    previous = (
        signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
    )
    net = Network()
    try:
        for name in ("ctl", *GPU_HOSTS):
            net.add_host(name)
        yield net
    finally:
        try:
            net.close()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def control_services(network: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlServices]:
    from animastor_tasks.adapters.postgres.migrations import migrate
    from animastor_tasks.adapters.postgres.pool import Database

    began = time.monotonic()
    services = ControlServices(network.hosts["ctl"], tmp_path_factory.mktemp("control"))
    try:
        services.start()
        db = Database(services.database_url, max_size=1)
        try:
            migrate(db)
        finally:
            db.close()
        services.timings["ready"] = time.monotonic() - began
        print(f"control host services up: {services.timings}")
        yield services
    finally:
        services.close()


@pytest.fixture(params=BROKERS)
def broker(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_cluster(
    request: pytest.FixtureRequest,
    network: Network,
    control_services: ControlServices,
    broker: str,
    tmp_path: Any,
) -> Iterator[Callable[..., ManyHosts]]:
    """`make_cluster(stages=<ANIMASTOR_STAGES json>, **ANIMASTOR_overrides)`: clean stores, a `ManyHosts`.

    Short settings by default (tick 1 s, presence TTL 3 s, reconcile 2 s) so that a fault plays out in
    seconds; the broker is the `broker` parameter's (the control host's Redis, or a fresh RabbitMQ vhost).
    """
    made: list[ManyHosts] = []
    vhosts: list[str] = []

    def build(*, stages: str, **overrides: Any) -> ManyHosts:
        from animastor_tasks.adapters.postgres.pool import Database

        db = Database(control_services.database_url, max_size=1)
        try:
            with db.transaction() as conn:
                conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
        finally:
            db.close()
        client = redis.Redis.from_url(control_services.redis_url)
        client.flushall()
        client.close()
        tag = secrets.token_hex(3)
        broker_url = control_services.redis_url
        if broker == "amqp":
            vhost = f"cluster-{tag}"
            control_services.rabbitmqctl("add_vhost", vhost)
            vhosts.append(vhost)
            control_services.rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
            broker_url = control_services.amqp_url(vhost)
        env = {
            "ANIMASTOR_DATABASE_URL": control_services.database_url,
            "ANIMASTOR_REDIS_URL": control_services.redis_url,
            "ANIMASTOR_BROKER_URL": broker_url,
            "ANIMASTOR_KEY_PREFIX": "cluster",
            "ANIMASTOR_TICK_SECONDS": "1",
            "ANIMASTOR_RECONCILE_SECONDS": "2",
            "ANIMASTOR_PRESENCE_TTL_SECONDS": "3",
            "ANIMASTOR_STAGES": stages,
            **control_services.artifact_env(f"artifacts-{tag}"),
        }
        env.update({f"ANIMASTOR_{k.upper()}": str(v) for k, v in overrides.items()})
        cluster = ManyHosts(
            network, control_services, tmp_path / f"cluster{len(made)}", env, broker=broker, test=request.node.name
        )
        made.append(cluster)
        return cluster

    try:
        yield build
    finally:
        failed = any(
            getattr(request.node, f"rep_{w}", None) and request.node.__dict__[f"rep_{w}"].failed
            for w in ("setup", "call")
        )
        for cluster in made:
            if failed:
                print(f"\n===== process logs ({request.node.name}) =====\n{cluster.diagnostics()}")
            cluster.close()
        for vhost in vhosts:
            with contextlib.suppress(AssertionError):
                control_services.rabbitmqctl("delete_vhost", vhost)
