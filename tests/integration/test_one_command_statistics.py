"""Reads of a book's commands under the statistics taken just after a whole-book command. Real Postgres.

Autovacuum analyzes `command_targets` after such an insert: its statistics then know one command, which holds
every target, and any other command's targets are estimated at the whole table. The statements that look a
one-scene command's targets up (the refill's candidates, a commit's settle) scanned the table for them: 41 ms
per refill and 138 ms per commit (under the lane's lock) at 50,000 targets beside eight one-scene commands.
Counted here by the server itself (`pg_stat_xact_user_tables`), under the plan a fresh statement gets and the
generic plan a prepared one settles on.
"""

from __future__ import annotations

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


def _beside_one_scene_commands(rt: Any) -> None:
    """A book of 2,000 pending pairs under its whole-book command, analyzed, then ten one-scene commands."""
    regenerated(rt, "wide", chapters=4, scenes=500)
    with rt.db.transaction() as conn:
        conn.execute("ANALYZE command_targets")
    for chapter, scene in SCENES:
        regenerate_flow.regenerate(rt.ports, "wide", ["audio"], [[chapter, scene]], priority="interactive")


@pytest.mark.parametrize("plan", PLANS)
def test_the_candidate_read_looks_one_scene_commands_targets_up_by_key(rt: Any, plan: str) -> None:
    _beside_one_scene_commands(rt)
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        reads = GateReads(cast(Database, _InOneTransaction(conn)))
        for _ in range(3):
            reads.gate_candidates("wide", ["audio"], LIMIT)
        before = fetched(conn, "command_targets")
        rows = reads.gate_candidates("wide", ["audio"], LIMIT)
        cost = fetched(conn, "command_targets") - before
    assert rows is not None and len(rows.in_flight) == LIMIT
    # The whole-book command: its first few targets counted and one per candidate; each other: its one target.
    assert cost <= FEW_TARGETS + 2 * LIMIT + 4 * len(SCENES), f"fetched {cost} command targets"


@pytest.mark.parametrize("plan", PLANS)
def test_a_commits_settle_looks_one_scene_commands_targets_up_by_key(rt: Any, plan: str) -> None:
    _beside_one_scene_commands(rt)
    pair = (*SCENES[0], "audio")  # targeted by the whole-book command and by its own one-scene command
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        for _ in range(3):
            settle_commands(conn, "wide", pair)
        before = fetched(conn, "command_targets")
        settled = settle_commands(conn, "wide", pair)
        cost = fetched(conn, "command_targets") - before
        conn.rollback()
    assert settled == []  # both commands still have their targets pending
    assert cost <= 2 * FEW_TARGETS + 4 * len(SCENES), f"fetched {cost} command targets"
