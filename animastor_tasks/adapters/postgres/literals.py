"""State and status values written into the SQL text instead of passed as parameters.

A prepared statement runs on a generic plan, made once, only when that plan costs about what one made
for the values at hand costs. A state passed as a parameter cannot match a partial index (pending or
in-flight pairs, active commands) in a generic plan, so such statements were planned afresh on every
run: 0.1-0.8 ms each, about 2 ms of planning per job on its path. Written into the text, the value
matches the index and the generic plan wins. Only the project's own constants go here, never input.
"""

from __future__ import annotations

from collections.abc import Iterable

from animastor_tasks.domain.vocabulary import AUTHORIZING, ENDED, IN_FLIGHT, AssetState, CommandStatus


def sql_text(value: str) -> str:
    """`value` as a quoted SQL literal; a vocabulary value is a bare lower-case word."""
    if not value.replace("_", "").isalpha() or not value.islower():
        raise ValueError(f"not a vocabulary value: {value!r}")
    return f"'{value}'"


def sql_list(values: Iterable[str]) -> str:
    """`values` as a parenthesized list of SQL literals, for `IN`."""
    return "(" + ", ".join(sql_text(v) for v in sorted(values)) + ")"


# The values the statements name, quoted once at import rather than on every run of a statement.
PENDING = sql_text(AssetState.PENDING)
GENERATING = sql_text(AssetState.GENERATING)
ACTIVE = sql_text(CommandStatus.ACTIVE)
IN_FLIGHT_STATES = sql_list(IN_FLIGHT)
AUTHORIZING_STATUSES = sql_list(AUTHORIZING)
ENDED_STATUSES = sql_list(ENDED)  # as migration 0008's index names them
