"""Reads of a book's commands under the statistics taken just after a whole-book command. Real Postgres.

Autovacuum analyzes `command_targets` after such an insert: its statistics then know one command, which holds
every target, and any other command's targets are estimated at the whole table. The statements that look a
one-scene command's targets up (the refill's candidates, a commit's settle) scanned the table for them: 41 ms
per refill and 138 ms per commit (under the lane's lock) at 50,000 targets beside eight one-scene commands.
Counted here by the server itself (`pg_stat_xact_user_tables`), under the plan a fresh statement gets and the
generic plan a prepared one settles on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import psycopg
import pytest

from animastor_tasks.adapters.postgres.gate_reads import FEW_TARGETS, GateReads
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.adapters.postgres.settle import settle_commands
from animastor_tasks.flow import regenerate as regenerate_flow

from .test_read_costs import LIMIT, _InOneTransaction, fetched, regenerated

PLANS = ["force_custom_plan", "force_generic_plan"]
SCENES = [("ch4", f"s{n}") for n in range(491, 501)]
TABLES = "asset_states, commands, command_targets, scenes, books"


@contextmanager
def _statistics_in_one_transaction(rt: Any, plan: str, tables: str) -> Iterator[psycopg.Connection]:
    """A connection whose transaction analyzes `tables` first and is rolled back at the end: the statistics
    are the test's own, and no later test plans on them."""
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        conn.execute(f"ANALYZE {tables}")
        try:
            yield conn
        finally:
            conn.rollback()


def _one_scene_commands(rt: Any, book: str, scenes: list[tuple[str, str]]) -> None:
    for chapter, scene in scenes:
        regenerate_flow.regenerate(rt.ports, book, ["audio"], [[chapter, scene]], priority="interactive")


def _counted(conn: psycopg.Connection, read: Any, tables: tuple[str, ...]) -> list[int]:
    """Rows of each table the server fetched for `read`, after three runs (prepared from the first)."""
    for _ in range(3):
        read()
    before = [fetched(conn, table) for table in tables]
    read()
    return [fetched(conn, table) - b for table, b in zip(tables, before, strict=True)]


@pytest.mark.parametrize("plan", PLANS)
def test_the_candidate_read_looks_one_scene_commands_targets_up_by_key(rt: Any, plan: str) -> None:
    regenerated(rt, "wide", chapters=4, scenes=500)
    with _statistics_in_one_transaction(rt, plan, "command_targets") as conn:
        _one_scene_commands(rt, "wide", SCENES)
        reads = GateReads(cast(Database, _InOneTransaction(conn)))
        (cost,) = _counted(conn, lambda: reads.gate_candidates("wide", ["audio"], LIMIT), ("command_targets",))
        rows = reads.gate_candidates("wide", ["audio"], LIMIT)
    assert rows is not None and len(rows.in_flight) == LIMIT
    # The whole-book command: its first few targets counted and one per candidate; each other: its one target.
    assert cost <= FEW_TARGETS + 2 * LIMIT + 4 * len(SCENES), f"fetched {cost} command targets"


@pytest.mark.parametrize("plan", PLANS)
def test_a_commits_settle_looks_one_scene_commands_targets_up_by_key(rt: Any, plan: str) -> None:
    regenerated(rt, "wide", chapters=4, scenes=500)
    pair = (*SCENES[0], "audio")  # targeted by the whole-book command and by its own one-scene command
    with _statistics_in_one_transaction(rt, plan, "command_targets") as conn:
        _one_scene_commands(rt, "wide", SCENES)
        (cost,) = _counted(conn, lambda: settle_commands(conn, "wide", pair), ("command_targets",))
        settled = settle_commands(conn, "wide", pair)
    assert settled == []  # both commands still have their targets pending
    assert cost <= 2 * FEW_TARGETS + 4 * len(SCENES), f"fetched {cost} command targets"


def test_the_generic_plan_of_the_candidate_read_walks_a_big_books_pending_pairs_in_order(rt: Any) -> None:
    """Statistics that know a few commands estimate each at a share of the targets: the generic plan a pooled
    connection settles on then joined the whole-book command's targets to the book's scenes and sorted them
    (160 ms per refill at 50,000 pending pairs) rather than walking the pending pairs in reading order."""
    regenerated(rt, "wide", chapters=4, scenes=500)
    _one_scene_commands(rt, "wide", SCENES)
    regenerated(rt, "small", chapters=1, scenes=20)
    _one_scene_commands(rt, "small", [("ch1", f"s{n}") for n in range(1, 11)])
    with _statistics_in_one_transaction(rt, "force_generic_plan", TABLES) as conn:
        reads = GateReads(cast(Database, _InOneTransaction(conn)))
        tables = ("asset_states", "command_targets", "scenes")
        cost = _counted(conn, lambda: reads.gate_candidates("wide", ["audio"], LIMIT), tables)
        rows = reads.gate_candidates("wide", ["audio"], LIMIT)
    assert rows is not None and len(rows.in_flight) == LIMIT
    assert max(cost) <= 2 * FEW_TARGETS + 4 * LIMIT, f"fetched {cost} asset, target and scene rows"


@pytest.mark.parametrize("plan", PLANS)
def test_the_candidate_read_looks_each_scene_up_by_key_in_a_book_the_statistics_have_not_seen(
    rt: Any, plan: str
) -> None:
    """A book imported after the statistics were taken: estimated at a row, its scenes were joined by the book
    alone and filtered, so each candidate rescanned every scene of the book (86 ms at 50,000 pending pairs)."""
    regenerated(rt, "known", chapters=1, scenes=20)
    with _statistics_in_one_transaction(rt, plan, TABLES) as conn:
        regenerated(rt, "new", chapters=4, scenes=500)
        with rt.db.transaction() as other:  # the first half of the new book done
            other.execute(
                "UPDATE asset_states SET state = 'ready' WHERE book_id = 'new' AND chapter_id IN ('ch1', 'ch2')"
            )
        reads = GateReads(cast(Database, _InOneTransaction(conn)))
        cost = _counted(conn, lambda: reads.gate_candidates("new", ["audio"], LIMIT), ("scenes", "asset_states"))
        rows = reads.gate_candidates("new", ["audio"], LIMIT)
    assert rows is not None and len(rows.in_flight) == LIMIT
    assert max(cost) <= 4 * LIMIT, f"fetched {cost} scene and asset rows"
