"""animastor.gate is called as docs/schemas/gate-kwargs.schema.json says: `book_id` required, no other kwarg
than `lane` (the schema's `additionalProperties: false`). Both are refused before any store is read."""

from __future__ import annotations

import pytest

from animastor_tasks.errors import InvalidCommand


def test_a_gate_call_its_schema_refuses_is_an_invalid_command() -> None:
    from animastor_tasks.worker import tasks

    # It was a bare TypeError: the caller got no InvalidCommand naming the argument.
    with pytest.raises(InvalidCommand, match=r"animastor\.gate: missing required argument\(s\) book_id"):
        tasks.gate_task.run()
    with pytest.raises(InvalidCommand, match=r"animastor\.gate: missing required argument\(s\) book_id"):
        tasks.gate_task.run(lane="gpu.audio")
    # A misspelt `lane` was logged and ignored: a whole gate pass ran where a refill of one lane was asked for.
    with pytest.raises(InvalidCommand, match=r"animastor\.gate: unknown argument\(s\) lan\b"):
        tasks.gate_task.run(book_id="b1", lan="gpu.audio")
