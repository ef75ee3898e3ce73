"""Commands, their targets and cancel tombstones in Postgres.

A command is a reader's explicit intent; its targets move to `pending` in the same
transaction that creates it, and it settles (completed or failed) in the transaction
that makes its last target terminal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from animastor_tasks.adapters.postgres import journal
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.domain.types import Pair, SceneKey
from animastor_tasks.domain.vocabulary import (
    CANCELLABLE,
    IN_FLIGHT,
    TERMINAL,
    AssetState,
    CommandStatus,
    sources_of,
    values,
)
from animastor_tasks.errors import DuplicateCommand
from animastor_tasks.ports import CommandRow

ACTIVE = str(CommandStatus.ACTIVE)


class CommandStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create_commands(
        self, book: str, request_id: str, per_stage: dict[str, tuple[str, list[SceneKey]]], force: bool
    ) -> list[str]:
        """Commands (active) + targets + targets to `pending`, in one transaction.

        `per_stage` maps stage -> (command_id, [(chapter, scene)]). `DuplicateCommand` when
        the request id was used already (the caller replays the first answer).
        """
        created: list[str] = []
        try:
            # Pipeline mode: the statements need no answer from each other, so they travel together.
            with self.db.transaction() as conn, conn.pipeline():
                conn.execute("DELETE FROM cancel_tombstones WHERE book_id = %s", (book,))
                for stage, (command_id, scenes) in per_stage.items():
                    chapters = [c for c, _ in scenes]
                    scene_ids = [s for _, s in scenes]
                    conn.execute(
                        "INSERT INTO commands (command_id, book_id, stage, status, force, request_id)"
                        " VALUES (%s, %s, %s, %s, %s, %s)",
                        (command_id, book, stage, ACTIVE, force, request_id),
                    )
                    conn.execute(
                        "INSERT INTO command_targets (command_id, book_id, chapter_id, scene_id, stage)"
                        " SELECT %s, %s, c, s, %s FROM unnest(%s::text[], %s::text[]) AS t(c, s)",
                        (command_id, book, stage, chapters, scene_ids),
                    )
                    conn.execute(
                        "INSERT INTO asset_states (book_id, chapter_id, scene_id, stage)"
                        " SELECT %s, c, s, %s FROM unnest(%s::text[], %s::text[]) AS t(c, s) ON CONFLICT DO NOTHING",
                        (book, stage, chapters, scene_ids),
                    )
                    conn.execute(
                        "UPDATE asset_states a SET state = %s, error = NULL, updated_at = now()"
                        " FROM unnest(%s::text[], %s::text[]) AS t(c, s)"
                        " WHERE a.book_id = %s AND a.stage = %s AND a.chapter_id = t.c AND a.scene_id = t.s"
                        " AND a.state = ANY(%s)",
                        (AssetState.PENDING, chapters, scene_ids, book, stage, values(sources_of(AssetState.PENDING))),
                    )
                    detail = {"command_id": command_id, "targets": len(scenes), "force": force}
                    journal.record(conn, "command.created", book, detail, stage=stage)
                    created.append(command_id)
        except psycopg.errors.UniqueViolation as err:
            raise DuplicateCommand(f"command id {request_id} was already used") from err
        return created

    def commands_for_request(self, request_id: str) -> list[CommandRow]:
        with self.db.read() as conn:
            ids = [r[0] for r in conn.execute("SELECT command_id FROM commands WHERE request_id = %s", (request_id,))]
        return self.commands(command_ids=[str(i) for i in ids]) if ids else []

    def commands(
        self, *, book: str | None = None, command_ids: Sequence[str] | None = None, limit: int = 200
    ) -> list[CommandRow]:
        """Commands with their per-state progress, newest first."""
        params: list[Any] = [book] if book is not None else []
        where = "c.book_id = %s" if book is not None else "TRUE"
        if command_ids is not None:
            where += " AND c.command_id = ANY(%s::uuid[])"
            params.append(list(command_ids))
        with self.db.read() as conn:
            rows = conn.execute(
                "SELECT c.command_id, c.book_id, c.stage, c.status, c.reason, extract(epoch FROM c.created_at),"
                " a.state, count(*) FROM commands c"
                " JOIN command_targets t ON t.command_id = c.command_id"
                " LEFT JOIN asset_states a ON a.book_id = t.book_id AND a.chapter_id = t.chapter_id"
                "  AND a.scene_id = t.scene_id AND a.stage = t.stage"
                f" WHERE {where} AND c.command_id IN (SELECT command_id FROM commands c WHERE {where}"
                "  ORDER BY created_at DESC LIMIT %s)"
                " GROUP BY 1, 2, 3, 4, 5, 6, 7 ORDER BY 6 DESC, 3",
                [*params, *params, limit],
            ).fetchall()
        found: dict[str, dict[str, Any]] = {}
        for cid, book_id, stage, status, reason, created, state, count in rows:
            entry = found.setdefault(
                str(cid),
                {
                    "book_id": book_id,
                    "stage": stage,
                    "status": status,
                    "reason": reason,
                    "created": float(created),
                    "progress": dict.fromkeys([s.value for s in AssetState], 0),
                },
            )
            entry["progress"][state or AssetState.DIRTY] += int(count)
        return [
            CommandRow(
                cid,
                e["book_id"],
                e["stage"],
                e["status"],
                e["reason"],
                sum(e["progress"].values()),
                e["created"],
                e["progress"],
            )
            for cid, e in found.items()
        ]

    def block_stage(self, book: str, stage: str, reason: str) -> tuple[list[str], list[tuple[Pair, str | None]]]:
        """Active commands of the stage -> blocked; their in-flight pairs -> dirty.

        Returns (blocked command ids, released pairs with their dispatch ids).
        """
        with self.db.transaction() as conn:
            blocked = [
                str(r[0])
                for r in conn.execute(
                    "UPDATE commands SET status = %s, reason = %s, updated_at = now()"
                    " WHERE book_id = %s AND stage = %s AND status = %s RETURNING command_id",
                    (CommandStatus.BLOCKED, reason, book, stage, ACTIVE),
                )
            ]
            released = [
                ((c, s, stage), d)
                for c, s, d in conn.execute(
                    "UPDATE asset_states a SET state = %(dirty)s, updated_at = now()"
                    " FROM (SELECT chapter_id, scene_id, dispatch_id AS old_dispatch FROM asset_states"
                    "  WHERE book_id = %(book)s AND stage = %(stage)s AND state = ANY(%(flight)s) FOR UPDATE) o"
                    " WHERE a.book_id = %(book)s AND a.stage = %(stage)s AND a.chapter_id = o.chapter_id"
                    " AND a.scene_id = o.scene_id AND a.state = ANY(%(flight)s)"
                    " RETURNING a.chapter_id, a.scene_id, o.old_dispatch",
                    {"dirty": AssetState.DIRTY, "book": book, "stage": stage, "flight": values(IN_FLIGHT)},
                )
            ]
            if blocked:
                journal.record(conn, "command.blocked", book, {"reason": reason, "commands": blocked}, stage=stage)
        return blocked, released

    def cancel_book(self, book: str, reason: str | None) -> tuple[list[str], int, list[tuple[Pair, str]]]:
        """Tombstone; active/blocked commands -> cancelled; in-flight pairs -> dirty.

        Returns (cancelled command ids, released pair count, the released pairs that were
        dispatched, with their dispatch ids: the only ones holding leases or queued jobs).
        """
        with self.db.transaction() as conn:
            conn.execute(
                "INSERT INTO cancel_tombstones (book_id, reason) VALUES (%s, %s)"
                " ON CONFLICT (book_id) DO UPDATE SET reason = EXCLUDED.reason, cancelled_at = now()",
                (book, reason),
            )
            cancelled = [
                str(r[0])
                for r in conn.execute(
                    "UPDATE commands SET status = %s, reason = %s, updated_at = now()"
                    " WHERE book_id = %s AND status = ANY(%s) RETURNING command_id",
                    (CommandStatus.CANCELLED, reason or "cancelled", book, values(CANCELLABLE)),
                )
            ]
            rows = conn.execute(
                "UPDATE asset_states a SET state = %(dirty)s, updated_at = now()"
                " FROM (SELECT chapter_id, scene_id, stage, state AS old_state, dispatch_id AS old_dispatch"
                "  FROM asset_states WHERE book_id = %(book)s AND state = ANY(%(flight)s) FOR UPDATE) o"
                " WHERE a.book_id = %(book)s AND a.chapter_id = o.chapter_id AND a.scene_id = o.scene_id"
                " AND a.stage = o.stage AND a.state = ANY(%(flight)s)"
                " RETURNING a.chapter_id, a.scene_id, a.stage, o.old_state, o.old_dispatch",
                {"dirty": AssetState.DIRTY, "book": book, "flight": values(IN_FLIGHT)},
            ).fetchall()
            dispatched = [((c, s, st), d) for c, s, st, old, d in rows if old == AssetState.GENERATING and d]
            detail = {"reason": reason, "commands": cancelled, "released": len(rows)}
            journal.record(conn, "book.cancelled", book, detail)
        return cancelled, len(rows), dispatched

    def forced_in_flight(self, book: str, force_ttl: float) -> list[tuple[Pair, float]]:
        """In-flight pairs whose newest active command is forced and younger than `force_ttl`, each with the
        seconds left of that window: the force set lives in Redis, so after a Redis loss it is rebuilt from this."""
        with self.db.read() as conn:
            rows = conn.execute(
                "SELECT DISTINCT ON (t.chapter_id, t.scene_id, t.stage) t.chapter_id, t.scene_id, t.stage, c.force,"
                " %s - extract(epoch FROM now() - c.created_at)"
                " FROM commands c JOIN command_targets t ON t.command_id = c.command_id"
                " JOIN asset_states a ON a.book_id = t.book_id AND a.chapter_id = t.chapter_id"
                "  AND a.scene_id = t.scene_id AND a.stage = t.stage"
                " WHERE c.book_id = %s AND c.status = %s AND a.state = ANY(%s)"
                " ORDER BY t.chapter_id, t.scene_id, t.stage, c.created_at DESC",
                (force_ttl, book, ACTIVE, values(IN_FLIGHT)),
            ).fetchall()
        return [((c, s, st), float(left)) for c, s, st, force, left in rows if force and left > 0]

    def tombstoned_books(self) -> list[str]:
        with self.db.read() as conn:
            return [r[0] for r in conn.execute("SELECT book_id FROM cancel_tombstones")]

    def is_tombstoned(self, book: str) -> bool:
        with self.db.read() as conn:
            return conn.execute("SELECT 1 FROM cancel_tombstones WHERE book_id = %s", (book,)).fetchone() is not None

    def books_with_work(self) -> list[str]:
        """Books with an active command or an in-flight pair: the ones reconcile looks at."""
        with self.db.read() as conn:
            return [
                r[0]
                for r in conn.execute(
                    "SELECT book_id FROM commands WHERE status = %s"
                    " UNION SELECT book_id FROM asset_states WHERE state = ANY(%s)",
                    (ACTIVE, values(IN_FLIGHT)),
                )
            ]


def settle_commands(conn: psycopg.Connection[Any], book: str) -> None:
    """Active commands whose targets are all terminal become completed (or failed), in the caller's
    transaction: the one that made the last target terminal."""
    conn.execute(
        "UPDATE commands c SET status = CASE WHEN x.failed > 0 THEN %(failed_status)s ELSE %(completed)s END,"
        " reason = CASE WHEN x.failed > 0 THEN x.failed || ' of ' || x.total || ' targets failed' END,"
        " updated_at = now()"
        " FROM (SELECT t.command_id, count(*) AS total,"
        "  count(*) FILTER (WHERE a.state = %(failed_state)s) AS failed,"
        "  count(*) FILTER (WHERE a.state IS NULL OR NOT a.state = ANY(%(terminal)s)) AS open"
        "  FROM commands c2 JOIN command_targets t ON t.command_id = c2.command_id"
        "  LEFT JOIN asset_states a ON a.book_id = t.book_id AND a.chapter_id = t.chapter_id"
        "   AND a.scene_id = t.scene_id AND a.stage = t.stage"
        "  WHERE c2.book_id = %(book)s AND c2.status = %(active)s GROUP BY t.command_id) x"
        " WHERE c.command_id = x.command_id AND x.open = 0",
        {
            "failed_status": CommandStatus.FAILED,
            "completed": CommandStatus.COMPLETED,
            "failed_state": AssetState.FAILED,
            "terminal": values(TERMINAL),
            "book": book,
            "active": ACTIVE,
        },
    )
