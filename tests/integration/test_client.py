"""The public client against a real broker: fail fast when it is down, clear errors for bad calls."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from animastor_tasks.client import Client
from animastor_tasks.domain.registry import CONTROL_ORDER, CONTROL_QUEUE, SENT_AT_HEADER
from animastor_tasks.errors import AnimastorError, StoreUnavailable


def test_regenerate_fails_fast_when_the_broker_is_unreachable(settings) -> None:
    client = Client(replace(settings, broker_url="redis://127.0.0.1:1/0"), timeout=5)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        client.regenerate("b1", ["audio"])
    elapsed = time.monotonic() - started
    client.close()
    assert info.value.store == "broker" and "127.0.0.1:1" in str(info.value)
    assert elapsed < 10, elapsed


def test_cli_regenerate_with_broker_down_exits_3(settings) -> None:
    env = {**__import__("os").environ, "ANIMASTOR_BROKER_URL": "redis://:pw@127.0.0.1:1/0"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "animastor_tasks.operator.cli", "regenerate", "b1", "--stage", "audio"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 3, done.stderr
    assert "broker unavailable" in done.stderr and ":pw@" not in done.stderr
    assert time.monotonic() - started < 15


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("amqp://guest:wrong-password@127.0.0.1:5672//", "ACCESS_REFUSED"),
        ("amqp://guest:guest@127.0.0.1:5672/no-such-vhost", "NOT_ALLOWED"),
    ],
)
def test_a_broker_that_refuses_the_login_or_the_vhost_is_a_broker_error(settings, url: str, said: str) -> None:
    """py-amqp's AccessRefused and NotAllowed are no OperationalError: the CLI printed a 91-line traceback and
    exited 1, and a cancel's note that it may not have been applied was missing."""
    client = Client(replace(settings, broker_url=url), timeout=5)
    with pytest.raises(StoreUnavailable) as info:
        client.cancel("b1")
    client.close()
    assert info.value.store == "broker" and said in str(info.value) and "wrong-password" not in str(info.value)


def test_no_control_worker_times_out_with_a_clear_message(rt, settings) -> None:
    """It said the request "stays queued and runs when one starts": a control worker killed as it took it (acked
    before it runs) had lost it, and a hunt's operator waited for a regenerate that never came."""
    client = Client(settings, timeout=1)
    with pytest.raises(AnimastorError, match=r"no answer within 1s; is a control worker consuming animastor\.control"):
        client.regenerate("b1", ["audio"])
    with pytest.raises(AnimastorError, match=r"died as it took it lost it, so see `commands` before asking again"):
        client.regenerate("b1", ["audio"], command_id="7b1f4c9e-0d7c-4a53-9c1e-2f6d7e8a9b0c")
    client.close()


def test_a_result_store_lost_while_the_answer_is_awaited_is_a_store_error_not_a_traceback(rt, settings) -> None:
    """Old code: the connection error escaped as a bare RuntimeError, and the cleanup's own `ready()` raised another
    over it (the CLI printed a traceback and exited 1 rather than 3)."""
    from urllib.parse import urlsplit

    from tests.support.tcp_proxy import TcpProxy

    where = urlsplit(settings.redis_url)
    with TcpProxy((where.hostname or "127.0.0.1", where.port or 6379)) as proxy:
        through = settings.redis_url.replace(f"{where.hostname}:{where.port}", f"127.0.0.1:{proxy.port}", 1)
        client = Client(replace(settings, redis_url=through), timeout=3)
        threading.Timer(0.8, proxy.cut).start()
        started = time.monotonic()
        try:
            with pytest.raises(StoreUnavailable, match=r"redis unavailable .* result store unreachable after task"):
                client.regenerate("b1", ["audio"])
        finally:
            client.close()
    assert time.monotonic() - started < 15


# kombu's Redis transport: a queue's messages of priority step N wait in the list named '<queue>\x06\x16<N>' (0: the
# queue's own name).
NORMAL_LIST = f"{CONTROL_QUEUE}\x06\x16{CONTROL_ORDER['normal']}"


def _control_lists(rt) -> dict[int, list[dict]]:  # type: ignore[no-untyped-def]
    lists = {step: CONTROL_QUEUE if step == 0 else f"{CONTROL_QUEUE}\x06\x16{step}" for step in (0, 3, 6, 9)}
    return {step: [json.loads(raw) for raw in rt.redis.client.lrange(name, 0, -1)] for step, name in lists.items()}


def test_a_reader_s_scene_and_a_stop_all_wait_ahead_of_normal_and_bulk_regenerates(rt, settings) -> None:
    """One control queue, first in first out: a reader's interactive scene sent during a burst of 300 regenerates
    waited 2.6 s for the control workers to take the burst first. Each command says when it was sent, so that a
    Stop All taken before a regenerate sent ahead of it still stops it (`test_commands.py`)."""
    client = Client(settings)
    before = time.time()
    try:
        client.regenerate("b1", ["audio"], priority="bulk", wait=False)
        client.regenerate("b1", ["audio"], wait=False)
        client.regenerate("b1", ["audio"], priority="interactive", wait=False)
        client.cancel("b2", wait=False)
    finally:
        client.close()
    waiting = _control_lists(rt)
    tasks = {step: [m["headers"]["task"] for m in messages] for step, messages in waiting.items()}
    assert tasks == {
        0: ["animastor.cancel", "animastor.regenerate"],
        3: ["animastor.regenerate"],
        6: ["animastor.regenerate"],
        9: [],
    }
    stamps = [m["headers"][SENT_AT_HEADER] for messages in waiting.values() for m in messages]
    assert all(before <= stamp <= time.time() for stamp in stamps) and len(stamps) == 4


def test_an_empty_command_id_is_sent_as_given_not_replaced(rt, settings) -> None:
    """`command_id=""` was swapped for a fresh UUID on every call: a caller whose id came out empty made a new
    command (and GPU work) on each retry instead of hearing its id is not one."""
    client = Client(settings)
    try:
        client.regenerate("b1", ["audio"], command_id="", wait=False)
    finally:
        client.close()
    [raw] = rt.redis.client.lrange(NORMAL_LIST, 0, -1)
    _args, kwargs, _embed = json.loads(base64.b64decode(json.loads(raw)["body"]))
    assert kwargs["command_id"] == ""


@pytest.mark.parametrize(
    ("stages", "scenes"),
    [("all", None), (["audio"], ("ch", "s1")), (["audio"], "ch1"), (["audio"], [["ch1", "s1"], "s2"])],
)
def test_a_string_where_a_list_belongs_is_sent_as_given_for_the_worker_to_refuse(rt, settings, stages, scenes) -> None:
    """The client split a string into its characters: `regenerate(book, "all")` was sent as stages ['a', 'l', 'l']
    (refused as an unknown stage 'a'), and `scenes=("ch", "s1")` (one pair without its list) as the scenes
    [c, h] and [s, 1], a valid request for other scenes than the caller named: GPU work nobody asked for."""
    client = Client(settings)
    try:
        client.regenerate("b1", stages, scenes, wait=False)
    finally:
        client.close()
    [raw] = rt.redis.client.lrange(NORMAL_LIST, 0, -1)
    _args, kwargs, _embed = json.loads(base64.b64decode(json.loads(raw)["body"]))
    assert (kwargs["stages"], kwargs["scenes"]) == (stages, json.loads(json.dumps(scenes)))


def test_cli_regenerate_without_an_answer_says_which_command_id_to_resend_with(rt) -> None:
    """The id was made inside the client and never shown: after a timeout the natural retry made a second command
    (with force, stopping the first one's jobs once a control worker ran them both)."""
    command = ("regenerate", "b1", "--stage", "audio", "--timeout", "1")
    done = subprocess.run(
        [sys.executable, "-m", "animastor_tasks.operator.cli", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "no answer within 1s" in done.stderr, done.stderr
    hint = re.search(r"resend with --command-id ([0-9a-f-]{36})", done.stderr)
    assert hint, done.stderr
    # The queued message carries that id: a resend with it is the same request.
    [message] = rt.redis.client.lrange(NORMAL_LIST, 0, -1)
    assert json.loads(base64.b64decode(json.loads(message)["body"]))[1]["command_id"] == hint.group(1)


@pytest.mark.parametrize(
    ("task", "kwargs", "said"),
    [
        ("regenerate", {"book_id": "b1"}, "animastor.regenerate: missing required argument(s) stages"),
        ("regenerate", {"stages": ["audio"]}, "animastor.regenerate: missing required argument(s) book_id"),
        ("regenerate", {"book_id": "b1", "stages": ["audio"], "prority": "bulk"}, "unknown argument(s) prority"),
        ("cancel", {}, "animastor.cancel: missing required argument(s) book_id"),
        ("cancel", {"book_id": "b1", "why": "x"}, "animastor.cancel: unknown argument(s) why"),
    ],
)
def test_a_call_the_schema_refuses_is_an_invalid_command_not_a_type_error(rt, task, kwargs, said) -> None:
    """Python's own TypeError (a required argument missing, one the task does not name) reached a caller that used
    `send_task` as a bare TypeError, where the schema promises InvalidCommand; nothing is written either way."""
    from animastor_tasks.errors import InvalidCommand
    from animastor_tasks.worker import tasks

    with pytest.raises(InvalidCommand, match=re.escape(said)):
        getattr(tasks, task).run(**kwargs)
    assert rt.ports.commands.commands() == []


@pytest.mark.parametrize(
    ("task", "args", "kwargs", "said"),
    [
        ("regenerate", ["b1", ["audio"], None, None, True, None, "x"], {}, "too many positional arguments"),
        ("regenerate", ["b1"], {"book_id": "b1", "stages": ["audio"]}, "multiple values for argument 'book_id'"),
        ("cancel", ["b1", None, "x"], {}, "too many positional arguments"),
        ("gate_task", ["b1"], {"book_id": "b1"}, "multiple values for argument 'book_id'"),
    ],
)
def test_positional_arguments_the_task_cannot_take_are_an_invalid_command(rt, task, args, kwargs, said) -> None:
    """A message whose positional arguments its task cannot bind (`send_task(args=...)`) reached the caller as a bare
    TypeError; the Celery task is called as the worker calls it (its `__call__`)."""
    from animastor_tasks.errors import InvalidCommand
    from animastor_tasks.worker import tasks

    with pytest.raises(InvalidCommand, match=re.escape(said)):
        getattr(tasks, task)(*args, **kwargs)
    assert rt.ports.commands.commands() == []
