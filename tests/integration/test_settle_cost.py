"""What a job's commit reads to settle the commands of its pair, under its lane's lock, counted by the server
itself (`pg_stat_xact_user_tables`). Real Postgres.

A command of more than `FEW_TARGETS` targets (a chapter, say) looked for an in-flight target of its own among
every in-flight pair of its book, of every stage, and the pairs it had just forced sit at the end of the heap:
a commit of such a command's pair in a book of 50,000 pending pairs held the lane 50 ms (1 ms normally).
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from animastor_tasks.adapters.postgres.gate_reads import FEW_TARGETS
from animastor_tasks.adapters.postgres.settle import settle_commands
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import advertise
from .test_read_costs import fetched, regenerated

PENDING = 4 * 1000
CHAPTER = [("ch3", f"s{n}") for n in range(1, 151)]  # the chapter command's targets


def _last_in_the_heap(conn: psycopg.Connection, stage: str) -> None:
    """The chapter command's pairs of `stage` written again (in the caller's transaction): in a heap whose pages a
    whole-book command's moves left full, they land at its end, where a walk of the book's in-flight pairs in
    heap order reads them last, as a force leaves the pairs it moves."""
    conn.execute(
        "UPDATE asset_states SET updated_at = updated_at WHERE book_id = 'big' AND stage = %s"
        " AND chapter_id = 'ch3' AND scene_id = ANY(%s)",
        (stage, [scene for _, scene in CHAPTER]),
    )


@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("stage", ["audio", "image"])
def test_a_commit_settles_a_chapter_command_without_reading_the_books_in_flight_pairs(
    rt: Any, stage: str, plan: str
) -> None:
    """A whole-book audio command keeps 4,000 pairs pending; a chapter command of 150 scenes, of the same stage
    or the other one, has its pair committed: the settle reads about `FEW_TARGETS` pairs, whatever the book.
    (The settle alone is counted: on a table of 8,000 rows the commit's update itself may be planned as a scan.)"""
    regenerated(rt, "big", chapters=4, scenes=1000)
    advertise(rt, "gpu.image")
    regenerate_flow.regenerate(rt.ports, "big", [stage], [list(scene) for scene in CHAPTER])
    pair = (*CHAPTER[-1], stage)
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        in_flight = conn.execute(
            "SELECT count(*) FROM asset_states WHERE book_id = 'big' AND state IN ('pending', 'generating')"
        ).fetchone()
        _last_in_the_heap(conn, stage)  # rolled back, as all the rest
        # The pair's job done, as its commit leaves it just before it settles.
        conn.execute(
            "UPDATE asset_states SET state = 'ready' WHERE book_id = 'big' AND chapter_id = %s AND scene_id = %s"
            " AND stage = %s",
            pair,
        )
        settle_commands(conn, "big", pair)  # prepared from the first run (threshold 0): the plan the mode forces
        before = fetched(conn)
        settled = settle_commands(conn, "big", pair)
        cost = fetched(conn) - before
        conn.rollback()
    assert in_flight is not None and in_flight[0] >= PENDING
    assert settled == []  # both commands have targets pending
    # The whole-book command finds one of its own among the first in-flight pairs of its stage; the chapter
    # command among the first of its own targets, after at most `FEW_TARGETS` pairs of the stage.
    assert cost <= FEW_TARGETS + 10, f"a settle read {cost} asset rows of a book of {in_flight[0]} in flight"
