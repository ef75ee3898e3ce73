"""What the CLI says about the commands it sends (`regenerate`, `cancel`), answered by a real control worker (a
thread of this process, `celery.contrib.testing.worker`) on the real broker, the CLI a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from animastor_tasks.worker import wiring

from .helpers import make_book

#: The store variables as this run set them, before a test gives its control worker others.
_RUN_ENV = {
    key: os.environ.get(key) for key in ("ANIMASTOR_DATABASE_URL", "ANIMASTOR_REDIS_URL", "ANIMASTOR_BROKER_URL")
}


@contextlib.contextmanager
def control_worker(monkeypatch: pytest.MonkeyPatch, **env: str) -> Iterator[None]:
    """A control worker thread whose stores are this run's, but for the variables in `env`."""
    from celery.contrib.testing.worker import start_worker

    from animastor_tasks.domain.registry import CONTROL_QUEUE
    from animastor_tasks.worker.tasks import app

    with monkeypatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)  # for as long as it runs: it builds its wiring anew as it starts
        wiring.reset()
        try:
            with start_worker(app, perform_ping_check=False, queues=[CONTROL_QUEUE], shutdown_timeout=30):
                yield
        finally:
            wiring.reset()


def cli_sent(*args: str, stdout: Any = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    """The CLI as a subprocess on this run's stores (whatever the control worker beside it was given)."""
    env = {**os.environ, **{key: value for key, value in _RUN_ENV.items() if value is not None}}
    return subprocess.run(
        [sys.executable, "-m", "animastor_tasks.operator.cli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        env=env,
    )


def _flag_set(rt: Any, book: str) -> bool:
    """The book's cancel flag, read on a connection of its own (the worker's may point at a Redis that is down)."""
    client = redis.Redis.from_url(rt.settings.redis_url)
    try:
        return bool(client.exists(rt.redis.keys.cancel_flag(book)))
    finally:
        client.close()


def test_a_cancel_that_meets_a_postgres_outage_says_its_flag_is_set_and_to_send_it_again(rt, monkeypatch) -> None:
    """The Stop All's Redis flag goes first (flow/cancel.py), then Postgres fails: the CLI printed only `error:
    postgres unavailable`, as if nothing had happened, and nothing said that the running jobs stop already nor
    that the command must be sent again for the book's commands to end."""
    rt.catalog.import_book(make_book("b1", chapters=1, scenes=1))
    with control_worker(monkeypatch, ANIMASTOR_DATABASE_URL="postgresql://postgres:pw@127.0.0.1:1/none"):
        done = cli_sent("cancel", "b1")
    assert done.returncode == 3 and "postgres unavailable" in done.stderr and ":pw@" not in done.stderr, done.stderr
    assert _flag_set(rt, "b1")
    assert "the cancel flag is set" in done.stderr and "animastor-tasks cancel b1` again" in done.stderr, done.stderr


def test_a_cancel_that_meets_a_redis_outage_does_not_say_its_flag_is_set(rt, monkeypatch) -> None:
    """Redis down, the flag is what failed: nothing was applied, and the CLI must not say it was."""
    rt.catalog.import_book(make_book("b1", chapters=1, scenes=1))
    with control_worker(monkeypatch, ANIMASTOR_REDIS_URL="redis://127.0.0.1:1/0"):
        done = cli_sent("cancel", "b1")
    assert done.returncode == 3 and "redis unavailable" in done.stderr, done.stderr
    assert not _flag_set(rt, "b1")
    assert "flag is set" not in done.stderr and "animastor-tasks cancel b1` again" in done.stderr, done.stderr


def test_regenerate_says_why_a_command_is_blocked_and_when_it_was_a_resend(rt, monkeypatch) -> None:
    """Without --json, a BLOCKED command was one line (`... blocked 1 scene(s)`) with neither its reason nor how to
    unblock it, and a resend (`replayed: true` in --json) looked like a new command."""
    rt.catalog.import_book(make_book("b1", chapters=1, scenes=1))
    command_id = str(uuid.uuid4())
    with control_worker(monkeypatch):  # no audio worker: the command is BLOCKED
        first = cli_sent("regenerate", "b1", "--stage", "audio", "--command-id", command_id)
        again = cli_sent("regenerate", "b1", "--stage", "audio", "--command-id", command_id)
    assert first.returncode == 0 and again.returncode == 0, (first.stderr, again.stderr)
    assert "blocked" in first.stdout and "no_worker:audio" in first.stdout, first.stdout
    assert "animastor-tasks worker --stage audio" in first.stdout and "resent" not in first.stdout, first.stdout
    assert "resent" in again.stdout and "nothing new was created" in again.stdout, again.stdout


@pytest.mark.parametrize("as_json", [True, False])
def test_a_regenerate_whose_answer_cannot_be_written_says_so_and_how_to_read_it_again(rt, monkeypatch, as_json) -> None:
    """Its stdout a full disk: a raw `OSError` traceback (exit 1), and nothing said that the command was made nor
    which id reads its answer again; a new id is a second command."""
    rt.catalog.import_book(make_book("b1", chapters=1, scenes=1))
    command_id = str(uuid.uuid4())
    with control_worker(monkeypatch), open("/dev/full", "w") as full:
        done = cli_sent("regenerate", "b1", "--stage", "audio", "--command-id", command_id, *["--json"] * as_json,
                        stdout=full)  # fmt: skip
        again = cli_sent("regenerate", "b1", "--stage", "audio", "--command-id", command_id, "--json")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "error: the answer could not be written to stdout: No space left on device" in done.stderr, done.stderr
    assert f"resend with --command-id {command_id}" in done.stderr and "commands: " in done.stderr, done.stderr
    made = json.loads(again.stdout)
    assert made["replayed"] and made["commands"][0]["command_id"] in done.stderr, (again.stdout, done.stderr)


def test_a_read_whose_answer_cannot_be_written_exits_1_with_one_error_line(rt) -> None:
    rt.catalog.import_book(make_book("b1", chapters=1, scenes=1))
    for args in (("status", "b1", "--json"), ("status", "b1"), ("commands", "--json"), ("queues",)):
        with open("/dev/full", "w") as full:
            done = cli_sent(*args, stdout=full)
        assert done.returncode == 1, (args, done.stderr)
        assert done.stderr.strip().splitlines() == ["error: the answer could not be written to stdout: No space left"
                                                    " on device"], (args, done.stderr)  # fmt: skip
