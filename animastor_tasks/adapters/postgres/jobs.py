"""A GPU job's rows: the start (read under the pair's row lock), the commit and the failure.

The decision whether a job may start is not made here: `starting` reads the facts under
the lock and `domain.gate.decide_job_start` judges them, so the rule lives in one place.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from animastor_tasks.adapters.postgres import journal
from animastor_tasks.adapters.postgres.commands import settle_commands
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.domain.keys import book_lock, lane_lock
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import AssetState, CommandStatus
from animastor_tasks.ports import JobRow


class StartTransaction:
    """The open start transaction of `JobStore.starting`; `row` is None for an unknown pair."""

    def __init__(self, conn: psycopg.Connection[Any], book: str, pair: Pair, row: JobRow | None) -> None:
        self._conn, self._book, self._pair, self.row = conn, book, pair, row

    def record_start(self, token: int, dispatch_id: str) -> None:
        journal.record(
            self._conn, "job.started", self._book, {"token": token}, pair=self._pair, dispatch_id=dispatch_id
        )


class JobStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    @contextmanager
    def starting(self, book: str, pair: Pair) -> Iterator[StartTransaction]:
        """The pair's row, its scene input and its book's gate facts, read under the row lock.

        The lock serializes the start with a concurrent cancel: either the start commits
        first (and the job then sees the cancel through its watcher), or the cancel does
        and the facts read here show it.
        """
        chapter, scene, stage = pair
        with self.db.transaction() as conn:
            found = conn.execute(
                "SELECT a.state, a.fencing_token, a.dispatch_id, s.text, s.prompt,"
                " EXISTS (SELECT 1 FROM cancel_tombstones t WHERE t.book_id = a.book_id),"
                " EXISTS (SELECT 1 FROM commands c JOIN command_targets ct ON ct.command_id = c.command_id"
                "  WHERE c.book_id = a.book_id AND c.status = %s AND ct.chapter_id = a.chapter_id"
                "  AND ct.scene_id = a.scene_id AND ct.stage = a.stage),"
                " b.layer_config"
                " FROM asset_states a JOIN scenes s ON s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
                "  AND s.scene_id = a.scene_id JOIN books b ON b.book_id = a.book_id"
                " WHERE a.book_id = %s AND a.chapter_id = %s AND a.scene_id = %s AND a.stage = %s FOR UPDATE OF a",
                (CommandStatus.ACTIVE, book, chapter, scene, stage),
            ).fetchone()
            yield StartTransaction(conn, book, pair, None if found is None else JobRow(*found))

    def commit_job(
        self, book: str, pair: Pair, token: int, dispatch_id: str, artifact: dict[str, Any], lane: str
    ) -> bool:
        """`generating -> ready` + the artifact row, only if the token is still current."""
        owned = _owned(book, pair, token, dispatch_id)
        with self.db.transaction() as conn:
            _lock_capacity(conn, lane, book)
            done = conn.execute(
                "UPDATE asset_states a SET state = %(ready)s, artifact_sha256 = %(sha256)s,"
                " input_hash = s.input_hashes ->> a.stage, error = NULL, updated_at = now() FROM scenes s"
                f" WHERE {_OWNED} AND s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
                " AND s.scene_id = a.scene_id",
                {**owned, "ready": AssetState.READY, "sha256": artifact["sha256"]},
            ).rowcount
            if not done:
                return False
            conn.execute(
                "INSERT INTO artifacts (sha256, size_bytes, media_type, book_id, chapter_id, scene_id, stage,"
                " fencing_token, dispatch_id, generator, duration_ms, path)"
                " VALUES (%(sha256)s, %(size)s, %(media_type)s, %(book)s, %(chapter)s, %(scene)s, %(stage)s,"
                " %(token)s, %(dispatch_id)s, %(generator)s, %(duration_ms)s, %(path)s)",
                {**owned, **artifact},
            )
            detail = {"token": token, "sha256": artifact["sha256"]}
            journal.record(conn, "job.ready", book, detail, pair=pair, dispatch_id=dispatch_id)
            settle_commands(conn, book)
        return True

    def fail_job(self, book: str, pair: Pair, token: int, dispatch_id: str, error: str, lane: str) -> bool:
        """`generating -> failed` with the error, only if the token is still current."""
        with self.db.transaction() as conn:
            _lock_capacity(conn, lane, book)
            done = conn.execute(
                f"UPDATE asset_states a SET state = %(failed)s, error = %(error)s, updated_at = now() WHERE {_OWNED}",
                {**_owned(book, pair, token, dispatch_id), "failed": AssetState.FAILED, "error": error[:4000]},
            ).rowcount
            if done:
                journal.record(conn, "job.failed", book, {"error": error[:1000]}, pair=pair, dispatch_id=dispatch_id)
                settle_commands(conn, book)
        return bool(done)

    def token_is_current(self, book: str, pair: Pair, token: int, dispatch_id: str) -> bool:
        with self.db.read() as conn:
            row = conn.execute(
                f"SELECT 1 FROM asset_states a WHERE {_OWNED}", _owned(book, pair, token, dispatch_id)
            ).fetchone()
        return row is not None


# The pair is still this job's: generating under its token and dispatch id.
_OWNED = (
    "a.book_id = %(book)s AND a.chapter_id = %(chapter)s AND a.scene_id = %(scene)s AND a.stage = %(stage)s"
    " AND a.state = %(generating)s AND a.fencing_token = %(token)s AND a.dispatch_id = %(dispatch_id)s"
)


def _owned(book: str, pair: Pair, token: int, dispatch_id: str) -> dict[str, Any]:
    chapter, scene, stage = pair
    return {
        "book": book,
        "chapter": chapter,
        "scene": scene,
        "stage": stage,
        "generating": AssetState.GENERATING,
        "token": token,
        "dispatch_id": dispatch_id,
    }


def _lock_capacity(conn: psycopg.Connection[Any], lane: str, book: str) -> None:
    """A completion frees capacity under the locks a claim counts it under (lane, then book)."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (lane_lock(lane),))
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (book_lock(book),))
