"""The shape a task message's body must have before Celery unpacks it (worker/message_shape.py)."""

from __future__ import annotations

from typing import Any

import pytest

from animastor_tasks.worker.message_shape import SHAPE, body_problem


@pytest.mark.parametrize(
    "body",
    [
        [[], {"book_id": "b"}, {}],
        [["b"], {}, None],
        ((), {}, {"callbacks": None}),
        {"args": [], "kwargs": {}},  # Celery's hybrid protocol-1 body: Celery checks it itself
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
