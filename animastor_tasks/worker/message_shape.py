"""A task message whose body is not Celery's `[args, kwargs, options]` is refused, not fatal.

*Why:* Celery unpacks a message's body in the worker's main process, outside every handler of a bad
message. A body that was the kwargs object itself (what a service not written in Python sends, reading
`docs/schemas`), `null`, a number or `[]` killed the worker, and the message, restored unacknowledged, killed
every worker started after it: the queue's traffic (regenerate, cancel, the tick) stopped until someone
deleted the message by hand. Refused, it is logged with its body (Celery's `Received invalid task message`),
dropped, and its id stored as failed with the reason (as is any message Celery refuses as invalid), so a caller
waiting for its answer learns why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import Task, signals
from celery.exceptions import InvalidTaskError
from celery.worker.strategy import default

from animastor_tasks.errors import InvalidCommand

log = logging.getLogger("animastor.worker")

SHAPE = "its body must be the JSON list [args, kwargs, options]: [[], {...the task's kwargs...}, {}]"


def body_problem(body: Any) -> str | None:
    """What is wrong with a decoded protocol-2 body (None: nothing). A mapping with `args` is Celery's hybrid
    protocol-1 body, which Celery checks itself."""
    if isinstance(body, dict) and "args" in body:
        return None
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


def _kind(value: Any) -> str:
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    return {dict: "an object", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def checked(task: Task, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """Celery's default strategy, behind a check of the body's shape (`Task.Strategy`)."""
    handle = default(task, app, consumer, **kwargs)

    def on_message(message: Any, body: Any, *args: Any, **more: Any) -> Any:
        if body is None:  # protocol 2: the body is decoded here, as the default strategy would decode it
            problem = body_problem(message.payload)
            if problem is not None:
                raise InvalidTaskError(f"{task.name}: {problem}")
        return handle(message, body, *args, **more)

    return on_message


@signals.task_rejected.connect
def store_refusal(sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any) -> None:
    """A message Celery refused as invalid (this shape, pickle, kwargs not a mapping): its id stored as failed with
    the reason, so a caller waiting for the answer learns why rather than waiting out its timeout."""
    task_id = getattr(message, "headers", {}).get("id")
    if exc is None or not isinstance(task_id, str):
        return
    try:
        sender.app.backend.mark_as_failure(task_id, InvalidCommand(str(exc)))
    except Exception as err:  # the refusal is logged all the same; only the caller's answer is lost
        log.warning("[WORKER] refusal of task %s not stored: %s", task_id, err)


class ShapeCheckedTask(Task):
    """Every task of the app: its messages' bodies are checked before Celery unpacks them."""

    Strategy = f"{__name__}:checked"
