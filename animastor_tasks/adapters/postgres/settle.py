"""Settling commands: an active command none of whose targets can still progress becomes completed or failed.

Run in the transaction that made a target terminal or released it (a job's end, under its lane's lock).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import psycopg

from animastor_tasks.adapters.postgres import literals
from animastor_tasks.adapters.postgres.gate_reads import FEW_TARGETS, HAS_FEW_TARGETS, TARGETS_BY_KEY, has_target_in
from animastor_tasks.domain.targets import TargetCounts, settle
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import AssetState, CommandStatus

# The commands that target one pair (`settle_commands`' `pair`): picked before any of them is looked at.
_TARGETING = (
    " AND c.command_id IN (SELECT p.command_id FROM command_targets p WHERE p.book_id = %(book)s"
    " AND p.chapter_id = %(chapter)s AND p.scene_id = %(scene)s AND p.stage = %(stage)s)"
)


def settle_commands(conn: psycopg.Connection[Any], book: str, pair: Pair | None = None) -> list[str]:
    """Active commands none of whose targets can still progress become completed or failed
    (`domain.targets.settle`), in the caller's transaction: the one that made the last target terminal
    or released it. `pair`: the one pair the caller changed, so only the commands that target it are
    looked at (a job's end, under its lane's lock: each command looked at searches for a target in flight,
    67 ms per commit at 5,000 pairs and 21 active commands). Returns the settled command ids."""
    # Only a command none of whose unreleased targets is in flight can settle, and most of its life one is
    # (`has_target_in`). The head is the first in-flight pairs of each stage looked at (a whole-book command's are
    # nearly all its own), in the index's order (a limit made a scan of the table look cheap).
    rows = conn.execute(
        f"WITH looked_at AS MATERIALIZED (SELECT c.command_id, c.stage, {HAS_FEW_TARGETS} AS few FROM commands c"
        f"  WHERE c.book_id = %(book)s AND c.status = {literals.ACTIVE}{_TARGETING if pair else ''}),"
        " head AS MATERIALIZED (SELECT s.stage, f.chapter_id, f.scene_id"
        "  FROM (SELECT DISTINCT stage FROM looked_at WHERE NOT few) s CROSS JOIN LATERAL (SELECT chapter_id, scene_id"
        f"  FROM asset_states WHERE book_id = %(book)s AND stage = s.stage AND state IN {literals.IN_FLIGHT_STATES}"
        f"  ORDER BY state LIMIT {FEW_TARGETS}) f),"
        " settling AS MATERIALIZED (SELECT c.command_id FROM looked_at c"
        f"  WHERE NOT {has_target_in(literals.IN_FLIGHT_STATES, unreleased=True)})"
        " SELECT t.command_id, t.released, a.state, count(*) FROM settling c"
        f" CROSS JOIN LATERAL (SELECT * FROM command_targets t WHERE t.command_id = c.command_id"
        f"  {TARGETS_BY_KEY.format('t')}) t"
        " LEFT JOIN asset_states a ON a.book_id = t.book_id AND a.chapter_id = t.chapter_id"
        "  AND a.scene_id = t.scene_id AND a.stage = t.stage"
        " GROUP BY 1, 2, 3",
        {"book": book, **(dict(zip(("chapter", "scene", "stage"), pair, strict=True)) if pair else {})},
    ).fetchall()
    tallies: dict[str, dict[str, Any]] = defaultdict(lambda: {"total": 0, "ready": 0, "failed": 0, "released": {}})
    for cid, released, state, count in rows:
        tally = tallies[str(cid)]
        tally["total"] += count
        if released is not None:
            tally["released"][released] = tally["released"].get(released, 0) + count
        elif state == AssetState.READY:
            tally["ready"] += count
        elif state == AssetState.FAILED:
            tally["failed"] += count
    settled: list[str] = []
    for cid, tally in tallies.items():
        verdict = settle(TargetCounts(**tally))
        if verdict is None:
            continue
        status, reason = verdict
        conn.execute(
            "UPDATE commands SET status = %s, reason = %s, updated_at = now() WHERE command_id = %s AND status = %s",
            (status, reason, cid, str(CommandStatus.ACTIVE)),
        )
        settled.append(cid)
    return settled
