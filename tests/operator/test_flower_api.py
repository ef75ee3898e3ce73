"""Flower's HTTP API as the way in for services that do not speak Celery (docs/operations.md).

One stack for the module: Flower with basic auth and a control worker; the audio worker starts
inside a test, after its jobs were seen queued. The image stage has a consumer advertised but no
worker at all, so its jobs stay queued until a cancel sent through Flower ends them.
"""

from __future__ import annotations

import base64
import json
import secrets
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from animastor_tasks.dev.net import free_port
from tests.support import wait_for
from tests.support.stack import Stack

from . import http_get, make_book, operator_env

Auth = tuple[str, str]


def http_json(method: str, url: str, body: Any = None, auth: Auth | None = None) -> tuple[int, Any]:
    """(status, decoded JSON or text) of one request; an HTTP error status is returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, text = int(response.status), response.read().decode()
    except urllib.error.HTTPError as err:
        status, text = int(err.code), err.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@pytest.fixture(scope="module")
def api_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str, Auth]]:
    folder = tmp_path_factory.mktemp("flower-api")
    credentials = ("svc", secrets.token_urlsafe(16))
    with operator_env(folder) as env:
        stack = Stack(env, folder)
        try:
            port = free_port()
            stack.start_flower(port, {"ANIMASTOR_FLOWER_BASIC_AUTH": ":".join(credentials)})
            stack.start_control()
            base = f"http://127.0.0.1:{port}/"
            wait_for(lambda: http_get(base + "healthcheck")[0] == 200, 60, "Flower /healthcheck")
            stack.wait_consumers("animastor.control")
            # Flower's event receiver is live once a task run by the worker shows in /api/tasks.
            status, sent = http_json("POST", base + "api/task/send-task/animastor.tick", {}, credentials)
            assert status == 200, sent
            wait_for(lambda: sent["task-id"] in tasks(base, credentials, "animastor.tick"), 30, "Flower sees events")
            yield stack, base, credentials
            assert credentials[1] not in stack.log_text(), "the Flower password appeared in a log"
        finally:
            stack.close()


def tasks(base: str, auth: Auth, name: str) -> dict[str, dict[str, Any]]:
    """Flower's view of the tasks named `name`: {task id: info}."""
    status, found = http_json("GET", f"{base}api/tasks?taskname={name}&limit=1000", auth=auth)
    assert status == 200, found
    return dict(found)


def send(base: str, auth: Auth, task: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Send a task through Flower and return its result, read back through Flower."""
    status, sent = http_json("POST", f"{base}api/task/send-task/{task}", {"kwargs": kwargs}, auth)
    assert status == 200, sent
    assert set(sent) >= {"task-id", "state"}, sent

    def finished() -> dict[str, Any] | None:
        # Polled without `?timeout=`: with it, Flower 2.x answers the state it read before waiting.
        status, answer = http_json("GET", f"{base}api/task/result/{sent['task-id']}", auth=auth)
        assert status == 200, answer
        return dict(answer) if answer["state"] in ("SUCCESS", "FAILURE") else None

    answer = wait_for(finished, 30, f"{task} finished")
    assert answer["state"] == "SUCCESS", answer
    return dict(answer["result"])


def test_send_task_needs_credentials(api_stack: tuple[Stack, str, Auth]) -> None:
    _, base, (user, password) = api_stack
    url = base + "api/task/send-task/animastor.regenerate"
    body = {"kwargs": {"book_id": "nobody", "stages": ["audio"]}}
    assert http_json("POST", url, body)[0] == 401
    assert http_json("POST", url, body, (user, password + "x"))[0] == 401
    assert http_json("GET", base + "api/task/result/" + str(uuid.uuid4()))[0] == 401


def test_regenerate_through_flower_queues_jobs_flower_shows_then_runs(api_stack: tuple[Stack, str, Auth]) -> None:
    stack, base, auth = api_stack
    book = f"api-{uuid.uuid4().hex[:6]}"
    stack.rt.catalog.import_book(make_book(book, scenes=2))
    # A consumer advertised but no GPU worker yet: the command is accepted and its jobs wait in gpu.audio.
    stack.rt.presence.heartbeat("no-gpu-yet@test", ["gpu.audio"], 60)
    result = send(base, auth, "animastor.regenerate", {"book_id": book, "stages": ["audio"]})
    assert [c["stage"] for c in result["commands"]] == ["audio"], result

    def queued() -> dict[str, dict[str, Any]] | None:
        mine = {k: v for k, v in tasks(base, auth, "animastor.generate.audio").items() if book in str(v.get("kwargs"))}
        return mine if len(mine) == 2 else None

    waiting = wait_for(queued, 30, "two queued audio jobs in Flower")
    assert {t["state"] for t in waiting.values()} <= {"PENDING", "RECEIVED"}, waiting
    assert all(t["started"] is None for t in waiting.values()), waiting

    stack.start_gpu("audio")
    stack.wait_commands(book, ["audio"], "completed", timeout=60)
    assert {state for (_, _, stage), state in stack.states(book).items() if stage == "audio"} == {"ready"}
    wait_for(
        lambda: all(tasks(base, auth, "animastor.generate.audio")[t]["state"] == "SUCCESS" for t in waiting),
        30,
        "Flower shows the jobs succeeded",
    )


def test_cancel_through_flower_cancels(api_stack: tuple[Stack, str, Auth]) -> None:
    stack, base, auth = api_stack
    book = f"api-{uuid.uuid4().hex[:6]}"
    stack.rt.catalog.import_book(make_book(book, scenes=2))
    stack.rt.presence.heartbeat("no-gpu-ever@test", ["gpu.image"], 60)  # jobs queue, nobody runs them
    send(base, auth, "animastor.regenerate", {"book_id": book, "stages": ["image"]})
    assert stack.commands(book)["image"].status == "active"

    result = send(base, auth, "animastor.cancel", {"book_id": book, "reason": "from-http"})
    assert result["book_id"] == book and result["cancelled_commands"], result
    assert stack.commands(book)["image"].status == "cancelled"
    assert {state for (_, _, stage), state in stack.states(book).items() if stage == "image"} == {"dirty"}
