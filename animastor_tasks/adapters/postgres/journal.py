"""The bounded event journal: one row per state change worth auditing, pruned by reconcile.

Every repository writes its events through `record`, inside its own transaction, so an
event exists exactly when the change it describes was committed.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from animastor_tasks.adapters.postgres.pool import Database

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
        `max_rows`. *Why 0:* read as "older than now", it emptied the journal on every reconcile."""
        with self.db.transaction() as conn:
            removed = 0
            if retention_days > 0:
                removed = conn.execute(
                    "DELETE FROM events WHERE at < now() - make_interval(secs => %s)", (retention_days * 86400,)
                ).rowcount
            removed += conn.execute(
                "DELETE FROM events WHERE id <= (SELECT max(id) - %s FROM events)", (max_rows,)
            ).rowcount
        return removed
