"""The vocabulary values written into SQL text: bare lower-case words only, quoted; anything else refused."""

from __future__ import annotations

import pytest

from animastor_tasks.adapters.postgres.literals import sql_list, sql_text
from animastor_tasks.domain.vocabulary import IN_FLIGHT, AssetState, CommandStatus


def test_a_state_or_status_becomes_a_quoted_literal() -> None:
    assert sql_text(AssetState.PENDING) == "'pending'"
    assert sql_text(CommandStatus.ACTIVE) == "'active'"
    assert sql_list(IN_FLIGHT) == "('generating', 'pending')"


@pytest.mark.parametrize("value", ["it's", "pending' OR 'a'='a", "Pending", "", "in flight", "x;y", "1"])
def test_anything_but_a_bare_lower_case_word_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="not a vocabulary value"):
        sql_text(value)


def test_the_ended_statuses_are_those_the_pruning_index_names() -> None:
    """Migration 0008's partial index lists them in its text: a status added to `ENDED` needs a new index."""
    from importlib import resources

    from animastor_tasks.adapters.postgres.literals import ENDED_STATUSES

    sql = (resources.files("animastor_tasks.adapters.postgres") / "sql" / "0008_ended_commands.sql").read_text()
    assert ENDED_STATUSES == "('cancelled', 'completed', 'failed')"
    assert f"WHERE status IN {ENDED_STATUSES};" in sql
