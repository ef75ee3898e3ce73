"""The client's waits are bounded by its own timeout, and what it sent stays findable: a silent broker, a retry
after no answer, a fork, arguments JSON cannot carry, the connections of timed-out and closed clients."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from urllib.parse import urlsplit

import pytest

from animastor_tasks.client import Client
from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.errors import AnimastorError, InvalidCommand, StoreUnavailable
from tests.integration.helpers import make_book, queued_messages
from tests.support import wait_for
from tests.support.cluster import Cluster
from tests.support.silent_server import silent_server
from tests.support.tcp_proxy import FreezingProxy

ID = "6f1c2b9e-4c1e-4d0b-9a55-0c3e2f7b8a10"


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung Redis, a black-holed proxy)."""
    with silent_server() as port:
        yield port


SLACK = 0.8  # seconds past the timeout for what is not a wait: imports, connecting, raising


def test_a_broker_that_accepts_and_never_answers_is_a_store_error_within_the_timeout(settings, silent_listener) -> None:
    """Old code: no socket timeout on the broker's connection, the call blocked for minutes."""
    client = Client(replace(settings, broker_url=f"redis://127.0.0.1:{silent_listener}/0"), timeout=5)
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable) as info:
            client.regenerate("b1", ["audio"], wait=False)
    finally:
        client.close()
    assert info.value.store == "broker"
    assert time.monotonic() - started < 5 + SLACK


def test_a_redis_that_stops_answering_after_a_send_is_a_store_error_within_the_timeout(rt, settings) -> None:
    """Old code: the next LPUSH on the open connection waited for ever (measured > 45 s)."""
    where = urlsplit(settings.redis_url)
    with FreezingProxy((where.hostname or "127.0.0.1", where.port or 6379)) as proxy:
        through = settings.redis_url.replace(f"{where.hostname}:{where.port}", f"127.0.0.1:{proxy.port}", 1)
        client = Client(replace(settings, redis_url=through, broker_url=through), timeout=4)
        try:
            client.regenerate("b1", ["audio"], wait=False)
            proxy.frozen.set()
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match=f"resend with command_id={ID}"):
                client.regenerate("b1", ["audio"], command_id=ID, wait=False)
            assert time.monotonic() - started < 4 + SLACK
        finally:
            proxy.frozen.clear()
            client.close()


def test_a_result_store_that_never_answers_is_a_store_error_within_the_timeout(rt, settings, silent_listener) -> None:
    """Old code: Celery's result store waits 120 s per read (then reconnects and waits again); later, 1.5 times the
    timeout (the reconnect tried twice after the subscribe: 6.0 s)."""
    client = Client(replace(settings, redis_url=f"redis://127.0.0.1:{silent_listener}/0"), timeout=4)
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable, match="result store unreachable") as info:
            client.regenerate("b1", ["audio"], command_id=ID)
    finally:
        client.close()
    assert time.monotonic() - started < 4 + SLACK
    assert f"resend with command_id={ID}" in str(info.value)
    assert info.value.command_id == ID


@pytest.fixture
def control(rt, tmp_path) -> Iterator[Cluster]:
    """Book b1 imported, and a way to start a real control worker (stopped after the test)."""
    rt.catalog.import_book(make_book("b1"))
    cluster = Cluster(tmp_path, {}, rt.presence)
    try:
        yield cluster
    finally:
        cluster.close()


def test_a_call_without_an_answer_names_its_command_id_and_a_resend_with_it_is_one_command(
    rt, settings, control
) -> None:
    """Old code: the id the client made was in no outcome, so the natural retry made a second command."""
    client = Client(settings, timeout=1)
    try:
        with pytest.raises(AnimastorError, match="no answer within 1s") as info:
            client.regenerate("b1", ["audio"])
        found = re.search(r"resend with command_id=([0-9a-f-]{36})", str(info.value))
        assert found, str(info.value)
        assert info.value.command_id == found.group(1)  # a caller reads it without parsing the message
        queued = client.regenerate("b1", ["image"], wait=False)
        assert set(queued) == {"task_id", "command_id"}
        control.control()
        client.timeout = 30
        answer = client.regenerate("b1", ["audio"], command_id=found.group(1))
    finally:
        client.close()
    assert [c["command_id"] for c in answer["commands"]] == [found.group(1)]
    wait_for(lambda: queued_messages(rt, CONTROL_QUEUE) == 0, 20, "the control queue drained")
    wait_for(lambda: len(rt.ports.commands.commands()) == 2, 20, "the image command")
    time.sleep(0.5)
    by_stage = sorted((c.stage, c.command_id) for c in rt.ports.commands.commands())
    assert by_stage == [("audio", found.group(1)), ("image", queued["command_id"])]


def test_a_client_made_before_a_fork_answers_every_call_in_the_children(rt, settings, control) -> None:
    """Old code: the children shared the parent's result subscription and lost answers (2 and 3 of 10 here)."""
    control.control()
    client = Client(settings, timeout=10)
    client.cancel("b1")  # the parent's connections and subscription exist before the fork
    children = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports by its exit status
            lost = 0
            for n in range(10):  # a regenerate takes the control worker 2.5 s: two, and cheaper calls between
                try:
                    client.regenerate("b1", ["audio"]) if n in (0, 9) else client.cancel("b1")
                except BaseException:
                    lost += 1
            os._exit(lost)
        children.append(pid)
    lost = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    client.cancel("b1")  # and the parent still answers
    client.close()
    assert lost == [0, 0]


@pytest.mark.parametrize(
    ("call", "args"),
    [("regenerate", ("b1", {"audio"})), ("cancel", ("b1", object())), ("gate", ("b1", float("nan")))],
)
def test_an_argument_json_cannot_carry_is_an_invalid_command_and_nothing_is_sent(rt, settings, call, args) -> None:
    """Old code: kombu's EncodeError (or a NaN, which is not JSON) reached the caller raw."""
    client = Client(settings)
    try:
        with pytest.raises(InvalidCommand, match="must be JSON"):
            getattr(client, call)(*args, wait=False)
    finally:
        client.close()
    assert queued_messages(rt, CONTROL_QUEUE) == 0


def _connections(rt) -> int:
    """Redis connections on the test's database (the test's own are the same before and after)."""
    db = rt.redis.client.connection_pool.connection_kwargs.get("db", 0)
    return sum(1 for c in rt.redis.client.client_list() if int(c["db"]) == db and c["cmd"] != "client|list")


def test_closed_clients_leave_no_connection_open(rt, settings) -> None:
    """Old code: `close()` left the result store's connections open (12 after 30 cycles). The broker's (two) are
    kombu's, kept per URL for every client of the process: reused, not added to."""
    before = _connections(rt)
    for _ in range(20):
        client = Client(settings)
        client.regenerate("b1", ["audio"], wait=False)
        client.close()
    assert _connections(rt) - before <= 2


def test_a_timed_out_call_leaves_no_pending_result_or_subscription(rt, settings) -> None:
    """Old code: each timed-out call's result object and subscription stayed until its task finished."""
    client = Client(settings, timeout=0.3)
    try:
        for _ in range(3):
            with pytest.raises(AnimastorError, match="no answer"):
                client.cancel("b1")
        client.gate("b1", wait=False)
        backend = client.app.backend
        assert backend._pending_results.concrete == {}
        assert not backend.result_consumer.subscribed_to
    finally:
        client.close()
