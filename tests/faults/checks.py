"""Checks shared by the fault tests, written as SQL of their own against the journal (not the product's code)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tests.support.stack import Stack

# Every `dispatch` event must be for a pair that, when it was dispatched, had a command of its stage
# targeting it that was created before and not yet over (no cancel of the book, no BLOCK of the stage, not
# completed in between), with the stage's layer enabled.
#
# "Before" is the journal's id order, not `at`: `at` is `now()`, the *start* of each transaction, while a
# claim and a concurrent cancel or block are ordered by their row locks on asset_states (the second waits
# for the first to commit before it writes its event). A claim that started after a cancel started but took
# the row locks first committed first (the cancel then released the pair and revoked its job): authorized at
# its moment. A claim after the cancel's commit finds the pair `dirty` and writes nothing.
UNAUTHORIZED_DISPATCHES = """
WITH created AS MATERIALIZED (
    SELECT (detail ->> 'command_id')::uuid AS command_id, id AS made FROM events WHERE kind = 'command.created'
), stops AS MATERIALIZED (
    SELECT id, book_id, kind, stage FROM events WHERE kind IN ('book.cancelled', 'command.blocked')
), dispatched AS MATERIALIZED (
    SELECT e.id, e.book_id, e.chapter_id, e.scene_id, e.stage, e.dispatch_id, e.at,
           coalesce((SELECT max(s.id) FROM stops s
                     WHERE s.book_id = e.book_id AND s.id < e.id
                       AND (s.kind = 'book.cancelled' OR s.stage = e.stage)), 0) AS last_stop
    FROM events e WHERE e.kind = 'dispatch' AND (%(book)s::text IS NULL OR e.book_id = %(book)s)
)
SELECT d.id, d.book_id, d.chapter_id, d.scene_id, d.stage, d.dispatch_id, d.at
FROM dispatched d
JOIN books b ON b.book_id = d.book_id
LEFT JOIN command_targets t ON t.book_id = d.book_id AND t.chapter_id = d.chapter_id
 AND t.scene_id = d.scene_id AND t.stage = d.stage
LEFT JOIN commands c ON c.command_id = t.command_id
LEFT JOIN created m ON m.command_id = c.command_id
GROUP BY d.id, d.book_id, d.chapter_id, d.scene_id, d.stage, d.dispatch_id, d.at, b.layer_config
HAVING NOT coalesce(bool_or(
           m.made < d.id AND m.made > d.last_stop
           AND (c.status NOT IN ('completed', 'failed') OR c.updated_at >= d.at)
       ), false)
    OR NOT coalesce((b.layer_config::jsonb ->> (d.stage || '_enabled'))::boolean, true)
ORDER BY d.id
"""


def unauthorized_dispatches(stack: Stack, book: str | None = None) -> list[tuple[Any, ...]]:
    return stack.query(UNAUTHORIZED_DISPATCHES, {"book": book})  # type: ignore[arg-type]  # psycopg takes a dict


def duplicated_commits(stack: Stack, book: str) -> dict[tuple[str, str, str], int]:
    """Pairs committed more than once (job.ready events or artifact rows), with their count."""
    ready = Counter((e["chapter_id"], e["scene_id"], e["stage"]) for e in stack.events("job.ready", book))
    rows = Counter((r["chapter_id"], r["scene_id"], r["stage"]) for r in stack.artifacts(book))
    return {pair: max(ready[pair], rows[pair]) for pair in set(ready) | set(rows) if max(ready[pair], rows[pair]) > 1}


def check_runs(stack: Stack, book: str, pairs: set[tuple[str, str, str]], runs: int) -> None:
    """Each pair committed exactly `runs` times (one job.ready and one artifact row per forced run), its newest
    artifact made under its current token and dispatch, the file present with the right sha256."""
    if runs == 1:
        stack.check_artifacts(book, pairs)  # the harness's exact check: one row per pair, file and hash
    ready = Counter((e["chapter_id"], e["scene_id"], e["stage"]) for e in stack.events("job.ready", book))
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in stack.artifacts(book):
        rows.setdefault((row["chapter_id"], row["scene_id"], row["stage"]), []).append(row)
    assets = stack.asset_rows(book)
    wrong = {p: (ready[p], len(rows.get(p, []))) for p in pairs if (ready[p], len(rows.get(p, []))) != (runs, runs)}
    assert wrong == {}, f"pairs with (job.ready, artifact rows) != ({runs}, {runs}): {wrong}"
    assert set(rows) == pairs and set(ready) == pairs
    for pair in pairs:
        newest, asset = rows[pair][-1], assets[pair]
        assert asset["state"] == "ready", (pair, asset)
        assert (newest["fencing_token"], newest["dispatch_id"]) == (asset["token"], asset["dispatch_id"]), pair
        assert newest["sha256"] == asset["sha256"], pair
