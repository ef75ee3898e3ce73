"""Issue 7, item 11: hostile or broken messages on the control queue, published with kombu directly.

A pickle-serialized regenerate (must never be deserialized, let alone run), a body that is not JSON, a
regenerate with wrong kwargs and one with wrongly typed kwargs, an unknown task name, a ~10 MB payload, and
bodies that are JSON but not `[args, kwargs, options]` (on a GPU queue too).
Each is rejected and logged by the control worker, nothing is written for any of them, the worker process
keeps running (same pid) and a regenerate sent afterwards completes.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from kombu import Connection, Exchange, Producer, Queue

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.worker.message_shape import SHAPE
from tests.e2e.harness import wait_for
from tests.integration.helpers import make_book

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

HUGE = 10 * 1024 * 1024
DROP = object()  # a header left out
PROTOCOL_1_TIMELIMIT = b'{"task": "animastor.gate_batch", "id": "p1", "args": [], "kwargs": {}, "timelimit": 5}'


def _headers(task: str, task_id: str) -> dict[str, Any]:
    """Celery task message protocol 2 headers."""
    return {
        "lang": "py",
        "task": task,
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "shadow": None,
        "eta": None,
        "expires": None,
        "retries": 0,
        "timelimit": [None, None],
        "argsrepr": "()",
        "kwargsrepr": "{...}",
        "origin": "faults-test",
        "ignore_result": False,
    }


def test_bad_control_messages_are_rejected_and_the_worker_keeps_serving(make_stack, figure) -> None:
    stack = make_stack()
    cluster = stack.cluster
    control, gpu = cluster.control(wait=False), cluster.gpu("audio", wait=False)
    cluster.wait_ready(control, gpu)
    book = make_book("bad-messages", chapters=1, scenes=3)
    stack.rt.catalog.import_book(book)
    good = {"book_id": book.book_id, "stages": ["audio"], "scenes": None, "command_id": None, "force": True}

    # (label, task name, kwargs or raw body, serializer, what the control worker must log for it)
    cases: list[tuple[str, str | dict[str, Any] | None, Any, str | None, str]] = [
        (
            "pickle",
            "animastor.regenerate",
            good,
            "pickle",
            "Received invalid task message: Refusing to deserialize untrusted content of type pickle",
        ),
        ("not json", "animastor.regenerate", b"{'not': json", None, "Can't decode message body: DecodeError"),
        (
            "wrong kwargs",
            "animastor.regenerate",
            {"book": book.book_id, "stage": "audio"},
            "json",
            "[{id}] raised expected: InvalidCommand('animastor.regenerate: missing required argument(s) book_id,"
            " stages')",
        ),
        (
            "wrong types",
            "animastor.regenerate",
            {"book_id": 42, "stages": "audio"},
            "json",
            "[{id}] raised expected: InvalidCommand('book_id: must be a string",
        ),
        ("unknown task", "animastor.nope", good, "json", "Received unregistered task of type 'animastor.nope'"),
        # Bodies that are not [args, kwargs, options]: each killed the worker, and every worker started after it.
        ("kwargs as body", "animastor.regenerate", json.dumps(good).encode(), None, f"{SHAPE}, got an object"),
        ("null body", "animastor.cancel", b"null", None, f"{SHAPE}, got null"),
        ("number body", "animastor.tick", b"5", None, f"{SHAPE}, got a number"),
        ("kwargs a list", "animastor.regenerate", b'[[], ["x"], {}]', None, f"{SHAPE}; its kwargs are a list of 1"),
        # Headers Celery fails on: each killed the worker (without an id, on Redis, it reconnected for ever).
        ("no id", {"id": DROP}, b"[[], {}, {}]", None, "tick: its id must be the task's id, a string, got none"),
        ("id a list", {"id": ["x"]}, b"[[], {}, {}]", None, "its id must be the task's id, a string, got a list of 1"),
        ("timelimit a number", {"timelimit": 5}, b"[[], {}, {}]", None, "its timelimit header must be [hard, soft]"),
        ("stamps a number", {"stamped_headers": 5}, b"[[], {}, {}]", None, "its stamped_headers header must be a list"),
        ("task a list", {"task": ["x"]}, b"[[], {}, {}]", None, "its task name must be a string, got a list of 1"),
        ("protocol 1, no id", None, b'{"task": "animastor.reconcile", "kwargs": {}}', None, "reconcile: its id must"),
        ("protocol 1, timelimit", None, PROTOCOL_1_TIMELIMIT, None, "gate_batch: its timelimit header must be"),
        (
            "10 MB payload",
            "animastor.regenerate",
            {"book_id": "x" * HUGE, "stages": ["audio"]},
            "json",
            '[{id}] raised expected: InvalidCommand("book_id: must be at most 200 characters (has 10485760)',
        ),
    ]
    queue = Queue(CONTROL_QUEUE, Exchange(CONTROL_QUEUE, type="direct"), routing_key=CONTROL_QUEUE)
    ids: dict[str, str] = {}
    sent = time.monotonic()
    with Connection(stack.env["ANIMASTOR_BROKER_URL"], connect_timeout=5) as conn:
        producer = Producer(conn.channel())
        gpu_queue = Queue("gpu.audio", Exchange("gpu.audio", type="direct"), routing_key="gpu.audio")
        producer.publish(
            json.dumps({"book_id": book.book_id}).encode(),
            exchange=gpu_queue.exchange,
            routing_key=gpu_queue.routing_key,
            declare=[gpu_queue],
            headers=_headers("animastor.generate.audio", str(uuid.uuid4())),
            content_type="application/json",
            content_encoding="utf-8",
        )
        for label, task, payload, serializer, _ in cases:
            task_id = ids[label] = str(uuid.uuid4())
            if isinstance(payload, bytes):
                body: Any = payload
                options: dict[str, Any] = {"content_type": "application/json", "content_encoding": "utf-8"}
            else:
                body = ((), payload, {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
                options = {"serializer": serializer}
            if task is None:  # protocol 1: everything in the body
                headers = {}
            elif isinstance(task, dict):  # a tick's headers, these changed
                headers = {k: v for k, v in {**_headers("animastor.tick", task_id), **task}.items() if v is not DROP}
            else:
                headers = _headers(task, task_id)
            producer.publish(
                body,
                exchange=queue.exchange,
                routing_key=queue.routing_key,
                declare=[queue],
                headers=headers,
                correlation_id=task_id,
                **options,
            )

    # Each is rejected and logged; the messages do not linger in the queue (acked or rejected, not stuck).
    def logged(needle: str) -> bool:
        return needle in control.log()

    for label, _, _, _, needle in cases:
        text = needle.replace("{id}", ids[label])
        wait_for(lambda n=text: logged(n), 30, what=f"control worker logs the rejection of the {label} message")
    handled = time.monotonic() - sent
    stored = ("pickle", "wrong kwargs", "wrong types", "10 MB payload", "kwargs as body", "null body", "kwargs a list")
    for label in stored:
        result = stack.client.app.AsyncResult(ids[label])
        assert wait_for(lambda r=result: r.state == "FAILURE", 10, what=f"{label}: stored as a failure"), label
        assert label != "kwargs as body" or f"{SHAPE}, got an object" in str(result.result), result.result
        result.forget()
    broker = stack.rt.redis.client
    wait_for(lambda: broker.llen(CONTROL_QUEUE) == 0, 10, what="control queue drained")
    assert control.alive(), control.tail()
    wait_for(lambda: f"animastor.generate.audio: {SHAPE}, got an object" in gpu.log(), 30, what="GPU worker refuses")
    assert gpu.alive(), gpu.tail()
    assert stack.rt.ports.commands.commands(book=book.book_id) == [], "a rejected message wrote a command"
    assert stack.query("SELECT count(*) FROM commands")[0][0] == 0

    # The same worker process keeps serving: a regenerate completes.
    pid = control.pid
    began = time.monotonic()
    stack.client.regenerate(book.book_id, ["audio"])
    stack.wait_commands(book.book_id, ["audio"], "completed", timeout=30)
    served = time.monotonic() - began
    assert control.alive() and control.pid == pid
    assert len(cluster.procs) == 2  # nothing was restarted
    audio = {p for p in stack.states(book.book_id) if p[2] == "audio"}
    stack.check_artifacts(book.book_id, audio)
    figure(
        f"trials {len(cases)} bad messages ({', '.join(label for label, *_ in cases)}): {len(cases)} rejected and "
        f"logged within {handled:.2f}s, 0 written, control worker pid unchanged; a regenerate afterwards "
        f"completed in {served:.2f}s; lost 0, duplicated 0"
    )


def test_a_command_sent_to_a_gpu_queue_is_refused_at_once(make_stack) -> None:
    """A regenerate, Stop All or gate pass sent to a GPU queue ran on a GPU worker, after every job queued before it
    in that lane: a Stop All answered after 15 s in a hunt, jobs starting meanwhile (hours with real jobs). It is the
    caller's error: refused by whichever worker takes it, naming the queue, with nothing written."""
    stack = make_stack()
    cluster = stack.cluster
    cluster.wait_ready(cluster.control(wait=False), cluster.gpu("audio", wait=False))
    book = make_book("misrouted", chapters=1, scenes=2)
    stack.rt.catalog.import_book(book)
    sent = {
        "animastor.cancel": {"book_id": book.book_id},
        "animastor.regenerate": {"book_id": book.book_id, "stages": ["audio"]},
        "animastor.gate": {"book_id": book.book_id},
    }
    for task, kwargs in sent.items():
        result = stack.client.app.send_task(task, kwargs=kwargs, queue="gpu.audio")
        with pytest.raises(Exception) as caught:
            result.get(timeout=20)
        assert "sent to queue 'gpu.audio'; send it to 'animastor.control'" in str(caught.value), (task, caught.value)
    assert stack.rt.ports.commands.commands(book=book.book_id) == []
    assert not stack.rt.ports.commands.is_tombstoned(book.book_id)
    assert stack.events("dispatch", book.book_id) == []
    answer = stack.client.regenerate(book.book_id, ["audio"])  # on the control queue, the same request runs
    stack.wait_commands(book.book_id, ["audio"], "completed", timeout=30)
    assert [c["stage"] for c in answer["commands"]] == ["audio"]
