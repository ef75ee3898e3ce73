"""The shape a task message's body must have before Celery unpacks it (worker/message_shape.py)."""

from __future__ import annotations

from typing import Any

import pytest

from animastor_tasks.worker.message_shape import SHAPE, body_problem, message_problem


@pytest.mark.parametrize(
    "body",
    [
        [[], {"book_id": "b"}, {}],
        [["b"], {}, None],
        ((), {}, {"callbacks": None}),
    ],
)
def test_a_body_celery_can_unpack_passes(body: Any) -> None:
    assert body_problem(body) is None


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"book_id": "b", "stages": ["audio"]}, "got an object"),
        (None, "got null"),
        (5, "got a number"),
        (2.5, "got a number"),
        ("[[], {}, {}]", "got a string"),
        (True, "got a boolean"),
        ([], "got a list of 0"),
        ([[], {}], "got a list of 2"),
        ([[], {}, {}, {}], "got a list of 4"),
        ([{}, {}, {}], "its args are an object"),
        ([[], ["x"], {}], "its kwargs are a list of 1"),
        ([[], None, {}], "its kwargs are null"),
        ([[], {}, "x"], "its options are a string"),
    ],
)
def test_a_body_celery_cannot_unpack_is_named(body: Any, said: str) -> None:
    problem = body_problem(body)
    assert problem is not None and problem.startswith(SHAPE) and problem.endswith(said), problem


class _Message:
    """What `message_problem` reads of a kombu message."""

    def __init__(self, headers: Any, payload: Any) -> None:
        self.headers, self._payload = headers, payload

    @property
    def payload(self) -> Any:
        if isinstance(self._payload, Exception):
            raise self._payload
        return self._payload


def _headers(**changed: Any) -> dict[str, Any]:
    headers = {"task": "animastor.tick", "id": "t1", "timelimit": [None, None], "stamped_headers": None}
    return {k: v for k, v in {**headers, **changed}.items() if v is not _DROP}


_DROP = object()
_BODY = [[], {}, {}]


@pytest.mark.parametrize(
    "message",
    [
        _Message(_headers(), _BODY),
        _Message(_headers(timelimit=[10, 5.5], stamped_headers=["a"]), _BODY),
        _Message(_headers(timelimit=_DROP, stamped_headers=_DROP), _BODY),
        _Message({}, {"task": "animastor.tick", "id": "t1", "args": [], "kwargs": {}}),  # protocol 1
        _Message(_headers(), {"task": "animastor.tick", "id": "t1", "args": [], "timelimit": [5, None]}),  # hybrid
        _Message(_headers(), ValueError("undecodable")),  # Celery refuses it itself, saying why
        _Message(None, _BODY),  # no headers: Celery's own "unknown message"
        _Message({}, [1, 2]),  # protocol 1 naming no task: the same
    ],
)
def test_a_message_celery_can_take_passes(message: _Message) -> None:
    assert message_problem(message) is None


@pytest.mark.parametrize(
    ("message", "said"),
    [
        (_Message(_headers(id=_DROP), _BODY), "animastor.tick: its id must be the task's id, a string, got none"),
        (_Message(_headers(id=""), _BODY), "got an empty string"),
        (_Message(_headers(id=["x"]), _BODY), "got a list of 1"),
        (_Message(_headers(id=5), _BODY), "got a number"),
        (_Message(_headers(timelimit=5), _BODY), "timelimit header must be [hard, soft], each seconds or null"),
        (_Message(_headers(timelimit=[1, "2"]), _BODY), "got a list of 2"),
        (_Message(_headers(timelimit=[True, None]), _BODY), "got a list of 2"),
        (_Message(_headers(stamped_headers=5), _BODY), "stamped_headers header must be a list of names, got a number"),
        (_Message(_headers(stamped_headers=[1]), _BODY), "got a list of 1"),
        (_Message(_headers(task=["x"]), _BODY), "its task name must be a string, got a list of 1"),
        (_Message(_headers(), {"book_id": "b"}), f"animastor.tick: {SHAPE}, got an object"),
        (_Message(_headers(), {"task": "animastor.tick", "id": "t1", "args": 5}), "its args must be a list, got a num"),
        (_Message(_headers(), {"task": "animastor.tick", "id": "t1", "args": [], "kwargs": [1]}), "kwargs must be"),
        (_Message(_headers(), {"task": "animastor.tick", "id": "t1", "args": [], "timelimit": 5}), "timelimit header"),
        (_Message(_headers(), {"args": []}), "its task name must be a string, got null"),  # hybrid: the body's task
        (_Message({}, {"task": "animastor.tick", "id": "t1", "timelimit": 5}), "animastor.tick: its timelimit header"),
        (_Message({}, {"task": "animastor.tick", "kwargs": {}}), "animastor.tick: its id must be the task's id"),
        (_Message({}, {"task": ["x"], "id": "t1"}), "its task name must be a string, got a list of 1"),
    ],
)
def test_a_message_celery_cannot_take_is_named(message: _Message, said: str) -> None:
    problem = message_problem(message)
    assert problem is not None and said in problem, problem
