"""Settling commands: an active command none of whose targets can still progress becomes completed or failed.

Run in the transaction that made a target terminal or released it (a job's end, under its lane's lock).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import psycopg

from animastor_tasks.adapters.postgres import literals
from animastor_tasks.adapters.postgres.gate_reads import FEW_TARGETS_OF, HAS_FEW_TARGETS, TARGETS_BY_KEY, pair_row_of
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
    looked at (a job's end, under its lane's lock: each command looked at reads the book's in-flight pairs,
    67 ms per commit at 5,000 pairs and 21 active commands). Returns the settled command ids."""
    # Only a command none of whose targets is in flight can settle, and most of a command's life one is:
    # for a command of many targets the in-flight pairs (a partial index) find it at once, so a job's commit,
    # which settles under the lane's lock, does not count every target of its command (0.5 ms at 160
    # targets, 3 ms at 1,000); a command of few targets looks its own up by key instead (reading the book's
    # in-flight pairs for its one scene cost a commit 4-5 ms at 5,000 of them).
    rows = conn.execute(
        "WITH open_in_flight AS (SELECT chapter_id, scene_id, stage FROM asset_states"
        f"  WHERE book_id = %(book)s AND state IN {literals.IN_FLIGHT_STATES} OFFSET 0),"
        f" looked_at AS MATERIALIZED (SELECT c.command_id, {HAS_FEW_TARGETS} AS few FROM commands c"
        f"  WHERE c.book_id = %(book)s AND c.status = {literals.ACTIVE}{_TARGETING if pair else ''}),"
        " settling AS MATERIALIZED (SELECT c.command_id FROM looked_at c"
        "  WHERE NOT EXISTS (SELECT 1 FROM open_in_flight f"
        "   JOIN command_targets o ON o.command_id = c.command_id AND o.chapter_id = f.chapter_id"
        "    AND o.scene_id = f.scene_id AND o.stage = f.stage WHERE NOT c.few AND o.released IS NULL)"
        f"  AND NOT EXISTS (SELECT 1 FROM ({FEW_TARGETS_OF.format('c')}) o {pair_row_of('o', 'state')} f"
        f"   WHERE o.released IS NULL AND f.state IN {literals.IN_FLIGHT_STATES}))"
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
