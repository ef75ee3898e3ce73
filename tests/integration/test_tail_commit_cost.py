"""What the last commits of a big command read under their lane's lock, counted by the server itself
(`pg_stat_xact_user_tables`). Real Postgres.

At the tail of a whole-book command nothing of its stage is pending any more, only its last jobs run. The commit's
read of what is left pending (`jobs._PENDING_RANK`) looked among the stage's first pending pairs, found none of the
command's, then walked every target of the command by key for a pending one: 50,000 asset rows, about 150 ms per
commit under the lane's lock, at each of the book's last `lane_limit` commits. The settle of its final commit
walked every target for an in-flight one the same way before it tallied them all."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from animastor_tasks.adapters.postgres.gate_reads import FEW_TARGETS
from animastor_tasks.adapters.postgres.settle import settle_commands

from .test_commit_leaves import pending_rank_read
from .test_read_costs import fetched, regenerated

CHAPTERS, SCENES = 4, 1000  # a whole-book command of 4,000 targets


@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_the_read_of_what_is_left_at_a_whole_book_commands_tail_does_not_walk_its_targets(rt: Any, plan: str) -> None:
    regenerated(rt, "big", chapters=CHAPTERS, scenes=SCENES)
    with rt.db.transaction() as conn:  # the tail: every pair done but the jobs that run
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'big' AND state = 'pending'")
    row, cost = pending_rank_read(rt, plan, "big")
    assert row == (None,)  # nothing left pending
    assert cost < 3 * FEW_TARGETS, f"the read fetched {cost} asset rows"


@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_the_settle_of_a_whole_book_commands_final_commit_reads_its_targets_once(rt: Any, plan: str) -> None:
    regenerated(rt, "big", chapters=CHAPTERS, scenes=SCENES)
    with rt.db.transaction() as conn:  # every pair done as its job's commit leaves it, the last one just now
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'big' AND state <> 'ready'")
    pair = ("ch1", "s1", "audio")
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        settle_commands(conn, "big", pair)  # prepared from the first run (threshold 0): the plan the mode forces
        conn.rollback()
        before = fetched(conn)
        settled = settle_commands(conn, "big", pair)
        cost = fetched(conn) - before
        conn.rollback()
    assert len(settled) == 1
    # The tally reads each target's pair once; the search for one in flight, the stage's first in-flight pairs.
    assert cost <= CHAPTERS * SCENES + FEW_TARGETS + 10, f"the settle fetched {cost} asset rows"
