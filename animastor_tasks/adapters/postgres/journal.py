"""The bounded event journal: one row per state change worth auditing, pruned by reconcile, as are the artifact
rows no pair points to any more.

Every repository writes its events through `record`, inside its own transaction, so an
event exists exactly when the change it describes was committed.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from animastor_tasks.adapters.postgres.pool import Database, answering_within

# The event of a change made by a statement whose RETURNING rows are the changed pairs:
# `WITH changed AS (UPDATE ... RETURNING ...) ` + EVENTS_FROM_CHANGED names each pair once.
EVENTS_FROM_CHANGED = (
    " journal AS (INSERT INTO events (kind, book_id, chapter_id, scene_id, stage, dispatch_id, detail)"
    "  SELECT %(kind)s, %(book)s, chapter_id, scene_id, stage, dispatch_id,"
    "  jsonb_build_object('token', fencing_token) FROM changed)"
)


def record(
    conn: psycopg.Connection[Any],
    kind: str,
    book: str,
    detail: dict[str, Any],
    *,
    pair: tuple[str, str, str] | None = None,
    stage: str | None = None,
    dispatch_id: str | None = None,
) -> None:
    """Journal one event in the caller's transaction."""
    chapter, scene, pair_stage = pair if pair is not None else (None, None, stage)
    conn.execute(
        "INSERT INTO events (kind, book_id, chapter_id, scene_id, stage, dispatch_id, detail)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (kind, book, chapter, scene, pair_stage, dispatch_id, Jsonb(detail)),
    )


class Journal:
    def __init__(self, db: Database) -> None:
        self.db = db

    def prune_journal(self, retention_days: float, max_rows: int) -> int:
        """Drop events older than the retention (0: no age limit, as for commands), then all but the newest
        `max_rows`. *Why 0:* read as "older than now", it emptied the journal on every reconcile. Not bounded by the
        answer limit (`pool.ANSWER_LIMIT_S`): a backlog (a lowered `ANIMASTOR_JOURNAL_MAX_ROWS`) may take longer to
        delete, and cut short each pass, it was rolled back each pass, with the rest of reconcile's pass after it."""
        with self.db.transaction() as conn, answering_within(conn, None):
            removed = 0
            if retention_days > 0:
                removed = conn.execute(
                    "DELETE FROM events WHERE at < now() - make_interval(secs => %s)", (retention_days * 86400,)
                ).rowcount
            removed += conn.execute(
                "DELETE FROM events WHERE id <= (SELECT max(id) - %s FROM events)", (max_rows,)
            ).rowcount
        return removed

    def prune_artifacts(self, retention_days: float, after: int, rows: int) -> tuple[int, int]:
        """Look at the `rows` artifact rows after id `after`, oldest first, and delete those older than the retention
        whose sha256 is not their pair's `artifact_sha256` (replaced, or their scene removed), or that a newer row
        of the pair with the same sha256 stands for (`artifact_uris` reads the newest): the files stay. *Why the
        last:* a generator that gives the same bytes again (the builtin, a fixed seed, a cached server) added a row
        per run that no pass pruned, 16 per pair in an hour's soak.
        Bounded in rows looked at, not deleted: the kept rows (each pair's current artifact) lie among the oldest,
        and a pass from the oldest read them all again before the first to delete. (rows deleted, the id the next
        pass goes on after: 0 once the slice reached a row inside the retention, or the end: a round starts over)."""
        with self.db.transaction() as conn:
            row = conn.execute(
                "WITH looked AS (SELECT id, created_at < now() - make_interval(secs => %(keep)s) AS old"
                "  FROM artifacts WHERE id > %(after)s ORDER BY id LIMIT %(rows)s),"
                " gone AS (DELETE FROM artifacts r USING looked l WHERE r.id = l.id AND l.old"
                "  AND (NOT EXISTS (SELECT 1 FROM asset_states a WHERE a.book_id = r.book_id"
                "   AND a.chapter_id = r.chapter_id AND a.scene_id = r.scene_id AND a.stage = r.stage"
                "   AND a.artifact_sha256 = r.sha256)"
                "  OR EXISTS (SELECT 1 FROM artifacts n WHERE n.book_id = r.book_id AND n.chapter_id = r.chapter_id"
                "   AND n.scene_id = r.scene_id AND n.stage = r.stage AND n.sha256 = r.sha256 AND n.id > r.id"
                "   AND (n.uri IS NOT NULL OR r.uri IS NULL))) RETURNING r.id)"
                " SELECT (SELECT count(*) FROM gone), count(*), coalesce(bool_and(old), false), max(id) FROM looked",
                {"keep": retention_days * 86400, "after": after, "rows": rows},
            ).fetchone()
        assert row is not None  # an aggregate: always one row
        pruned, looked, all_old, last = row
        return int(pruned), int(last) if looked == rows and all_old else 0
