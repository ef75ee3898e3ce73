"""A task message Celery cannot unpack is refused, not fatal (`guarded`, in the worker's consumer).

*Why:* Celery unpacks a message in the worker's main process, outside every handler of a bad message. A
body that was the kwargs object itself (what a service not written in Python sends, reading `docs/schemas`),
`null`, a number or `[]`, an `id` header that was a list or a `timelimit` that was a number killed the worker,
and the message, restored unacknowledged, killed every worker started after it: the queue's traffic
(regenerate, cancel, the tick) stopped until someone deleted the message by hand. One without an `id` was
worse on Redis, whose transport takes a KeyError for a lost connection: the worker reconnected for ever.
Refused, the message is logged with its body (Celery's `Received invalid task message`) and dropped, and its
id stored as failed with the reason (as is any message Celery refuses as invalid), so a caller waiting for
its answer learns why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import signals
from celery.exceptions import InvalidTaskError

from animastor_tasks.errors import InvalidCommand

log = logging.getLogger("animastor.worker")

SHAPE = "its body must be the JSON list [args, kwargs, options]: [[], {...the task's kwargs...}, {}]"


def guarded(consumer: Any, received: Callable[[Any], None]) -> Callable[[Any], None]:
    """`received` (Celery's handler of a task message) behind the checks below, a refusal as Celery refuses."""

    def on_task_received(message: Any) -> None:
        problem = message_problem(message)
        if problem is not None:
            consumer.on_invalid_task(None, message, InvalidTaskError(problem))
            return
        received(message)

    return on_task_received


def message_problem(message: Any) -> str | None:
    """What keeps Celery from unpacking a message (None: nothing, or what Celery refuses by itself: a body it
    cannot decode, a serializer it does not accept, a message that names no task)."""
    headers = message.headers
    if not isinstance(headers, dict):
        return None
    try:
        body = message.payload
    except Exception:
        return None
    if isinstance(body, dict) and ("task" not in headers or "args" in body):
        # Protocol 1, or Celery's hybrid of 1 and 2: the task, its id, its limits and its arguments in the body.
        return _named(body.get("task"), header_problem(body) or _hybrid_problem(body))
    if "task" not in headers:
        return None
    return _named(headers["task"], header_problem(headers) or body_problem(body))


def _named(task: Any, problem: str | None) -> str | None:
    if not isinstance(task, str):  # Celery looks it up in a dict: a list was a TypeError
        return f"its task name must be a string, got {_kind(task)}"
    return None if problem is None else f"{task}: {problem}"


def header_problem(headers: dict[str, Any]) -> str | None:
    """What is wrong with a message's headers (a protocol-1 body's fields), besides its task's name, that Celery would
    fail on (None: nothing)."""
    if problem := _id_problem(headers):
        return problem
    limits = headers.get("timelimit")
    numbers = (int, float)
    if limits is not None and not (
        isinstance(limits, list | tuple)
        and len(limits) == 2
        and all(x is None or (isinstance(x, numbers) and not isinstance(x, bool)) for x in limits)
    ):
        return f"its timelimit header must be [hard, soft], each seconds or null, got {_kind(limits)}"
    stamped = headers.get("stamped_headers")
    if stamped is not None and not (isinstance(stamped, list | tuple) and all(isinstance(s, str) for s in stamped)):
        return f"its stamped_headers header must be a list of names, got {_kind(stamped)}"
    return None


def _id_problem(fields: dict[str, Any]) -> str | None:
    task_id = fields.get("id")
    if isinstance(task_id, str) and task_id:
        return None
    got = "none" if "id" not in fields else "an empty string" if task_id == "" else _kind(task_id)
    return f"its id must be the task's id, a string, got {got}"


def body_problem(body: Any) -> str | None:
    """What is wrong with a decoded protocol-2 body (None: nothing)."""
    if not isinstance(body, list | tuple) or len(body) != 3:
        return f"{SHAPE}, got {_kind(body)}"
    args, kwargs, options = body
    if not isinstance(args, list | tuple):
        return f"{SHAPE}; its args are {_kind(args)}"
    if not isinstance(kwargs, dict):
        return f"{SHAPE}; its kwargs are {_kind(kwargs)}"
    if options is not None and not isinstance(options, dict):
        return f"{SHAPE}; its options are {_kind(options)}"
    return None


def _hybrid_problem(body: dict[str, Any]) -> str | None:
    if not isinstance(body.get("args", ()), list | tuple):
        return f"its args must be a list, got {_kind(body['args'])}"
    if not isinstance(body.get("kwargs", {}), dict):
        return f"its kwargs must be an object, got {_kind(body['kwargs'])}"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    return {dict: "an object", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


@signals.task_rejected.connect
def store_refusal(sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any) -> None:
    """A message Celery refused as invalid (these, pickle, kwargs not a mapping): its id stored as failed with the
    reason, so a caller waiting for the answer learns why rather than waiting out its timeout."""
    headers = getattr(message, "headers", None)
    task_id = headers.get("id") if isinstance(headers, dict) else None
    if exc is None or not isinstance(task_id, str) or not task_id:
        return
    try:
        sender.app.backend.mark_as_failure(task_id, InvalidCommand(str(exc)))
    except Exception as err:  # the refusal is logged all the same; only the caller's answer is lost
        log.warning("[WORKER] refusal of task %s not stored: %s", task_id, err)
