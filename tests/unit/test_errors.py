"""Our errors cross a Celery result intact: the caller of a task gets the same type, fields and message."""

from __future__ import annotations

import pickle

import pytest
from celery import Celery

from animastor_tasks.errors import (
    AnimastorError,
    ArtifactStoreError,
    BookBusy,
    InvalidCommand,
    InvalidTransition,
    JobFailed,
    StoreUnavailable,
)

ERRORS = [
    StoreUnavailable("postgres", "postgresql://u:secret@db/animastor", "connection refused"),
    ArtifactStoreError("s3://key:secret@bucket/x", "AccessDenied"),
    InvalidTransition("ready", "generating"),
    InvalidCommand("book_id: unknown book 'b9'"),
    BookBusy("b9", 1.0),  # a JSON backend rebuilt it as its base, a StoreUnavailable 'at :' (review)
    JobFailed("b9/ch1/s1 audio", "a scene no voice can read"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_an_error_a_task_raised_is_rebuilt_for_its_caller_as_itself(error: AnimastorError) -> None:
    """A JSON result backend sends the type and `args` and rebuilds `type(*args)`: a StoreUnavailable built
    from its message alone could not be rebuilt, and the client got a bare Exception (a CLI traceback, exit 1
    instead of 3)."""
    backend = Celery("errors-test", backend="cache+memory://", set_as_current=False).backend
    rebuilt = backend.exception_to_python(backend.prepare_exception(error, "json"))
    assert type(rebuilt) is type(error)
    assert str(rebuilt) == str(error)
    assert vars(rebuilt) == vars(error)
    assert type(pickle.loads(pickle.dumps(error))) is type(error)


def test_a_store_error_names_the_store_and_never_shows_a_password() -> None:
    error = StoreUnavailable("postgres", "postgresql://u:secret@db/animastor", "connection refused")
    assert str(error) == "postgres unavailable at postgresql://u:***@db/animastor: connection refused"
    assert "secret" not in repr(error.args)
