"""Commands, their targets and cancel tombstones in Postgres.

A command is a reader's explicit intent; its targets move to `pending` in the same
transaction that creates it (`domain.targets.regenerate_take` says which), and it settles
(completed or failed, `domain.targets.settle`) in the transaction that makes its last target
terminal or releases it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from animastor_tasks.adapters.postgres import journal, literals
from animastor_tasks.adapters.postgres.gate_reads import pair_columns
from animastor_tasks.adapters.postgres.locks import lock_book
from animastor_tasks.adapters.postgres.pool import ANALYZE_FROM_ROWS, Database
from animastor_tasks.adapters.postgres.released import release_targets
from animastor_tasks.domain import liveness, vocabulary
from animastor_tasks.domain.targets import Take, states_taking
from animastor_tasks.domain.types import Pair, SceneKey
from animastor_tasks.domain.vocabulary import CANCELLABLE, IN_FLIGHT, AssetState, CommandStatus, Priority, values
from animastor_tasks.errors import DuplicateCommand, InvalidCommand
from animastor_tasks.ports import CommandRow, NewCommands

ACTIVE = str(CommandStatus.ACTIVE)
_PRUNABLE, _BLOCKED = literals.sql_list(vocabulary.PRUNABLE), literals.sql_text(CommandStatus.BLOCKED)
_FLAG_KEPT = (  # the tombstoned books whose cancel flag reconcile keeps (`tombstoned_books`)
    "SELECT book_id FROM cancel_tombstones t WHERE cancelled_at > now() - make_interval(secs => %s)"
    f" OR EXISTS (SELECT FROM commands WHERE book_id = t.book_id AND status = {literals.ACTIVE}) OR EXISTS"
    f" (SELECT FROM asset_states WHERE book_id = t.book_id AND state IN {literals.IN_FLIGHT_STATES})"
)

_BOOK_SCENES = "SELECT chapter_id, scene_id FROM scenes WHERE book_id = %s ORDER BY position"


class CommandStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create_commands(
        self,
        book: str,
        request_id: str,
        per_stage: dict[str, tuple[str, list[SceneKey]]],
        force: bool,
        priority: Priority = Priority.NORMAL,
        asked: tuple[Sequence[str], bool] | None = None,
    ) -> NewCommands:
        """Commands (active) + targets, and each target taken as `domain.targets.regenerate_take` says, in
        one transaction: dirty/ready/failed -> `pending`; pending, and generating without force, stay (the
        queued or running work serves the new command); generating with force stays `generating` but is
        fenced off: its token moves on (the running job can neither commit nor fail it) and its input hash
        is cleared (the fresh run cannot be settled as already completed).

        `per_stage` maps stage -> (command_id, [(chapter, scene)]); `asked`: the stages the request named (`all`
        as such) and whether it asked for the whole book, kept with each command to hold a resend to (0009).
        A whole-book command targets the book's scenes under its lock, not those of `per_stage` (read before it: an
        import that removed one meanwhile failed the command as if a scene named was gone; none was).
        `DuplicateCommand` when the request id was used already (the caller replays the first answer).
        """
        kept = (None, None) if asked is None else (list(asked[0]), asked[1])  # requested_stages, whole_book
        every: list[SceneKey] | None = None
        created: list[str] = []
        superseded: list[tuple[Pair, str | None]] = []
        try:
            # Pipeline mode: the statements need no answer from each other, so they travel together.
            with self.db.transaction() as conn, conn.pipeline():
                # Committed without waiting for the WAL flush, which `command_statuses` waits for once the first
                # job is published: a millisecond off the path to the first job, and no answer says a command is
                # there that a database crash could still lose.
                conn.execute("SET LOCAL synchronous_commit = off")
                # Under the lock a job's commit settles under: a target whose job ends meanwhile is taken once
                # that commit is in (queued again, or fenced off), never seen `generating` by a command the
                # commit's settle could not see either.
                lock_book(conn, book)
                if kept[1]:
                    every = [(c, s) for c, s in conn.execute(_BOOK_SCENES, (book,))]
                    per_stage = {stage: (command_id, every) for stage, (command_id, _) in per_stage.items()}
                conn.execute("DELETE FROM cancel_tombstones WHERE book_id = %s", (book,))
                for stage, (command_id, scenes) in per_stage.items():
                    chapters = [c for c, _ in scenes]
                    scene_ids = [s for _, s in scenes]
                    conn.execute(
                        "INSERT INTO commands (command_id, book_id, stage, status, force, request_id, priority,"
                        " target_count, requested_stages, whole_book) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                        (command_id, book, stage, ACTIVE, force, request_id, priority, len(scenes), *kept),
                    )
                    conn.execute(
                        "INSERT INTO command_targets (command_id, book_id, chapter_id, scene_id, stage)"
                        " SELECT %s, %s, c, s, %s FROM unnest(%s::text[], %s::text[]) AS t(c, s)",
                        (command_id, book, stage, chapters, scene_ids),
                    )
                    # Only the missing rows are inserted: a new row looks up its scene's position (0006).
                    conn.execute(
                        "INSERT INTO asset_states (book_id, chapter_id, scene_id, stage)"
                        " SELECT %(book)s, c, s, %(stage)s"
                        " FROM unnest(%(chapters)s::text[], %(scenes)s::text[]) AS t(c, s)"
                        " WHERE NOT EXISTS (SELECT 1 FROM asset_states a WHERE a.book_id = %(book)s"
                        "  AND a.chapter_id = t.c AND a.scene_id = t.s AND a.stage = %(stage)s)"
                        " ON CONFLICT DO NOTHING",
                        {"book": book, "stage": stage, "chapters": chapters, "scenes": scene_ids},
                    )
                    queue = values(states_taking(Take.QUEUE, force))
                    # Forced, the reader asked for fresh media: a target's ready media no longer counts as made from
                    # its inputs (its hash cleared), so it is never settled `already_completed` from it, however long
                    # the pair waits for a slot (the force set, in Redis, lives one force window).
                    conn.execute(
                        "UPDATE asset_states a SET state = %s, error = NULL, updated_at = now(),"
                        " input_hash = CASE WHEN %s THEN NULL ELSE a.input_hash END"
                        " FROM unnest(%s::text[], %s::text[]) AS t(c, s)"
                        " WHERE a.book_id = %s AND a.stage = %s AND a.chapter_id = t.c AND a.scene_id = t.s"
                        " AND a.state = ANY(%s)",
                        (AssetState.PENDING, force, chapters, scene_ids, book, stage, queue),
                    )
                    fenced: list[tuple[Pair, str | None]] = []
                    rerun = states_taking(Take.RERUN, force)
                    if rerun:
                        fenced = [
                            ((c, s, stage), d)
                            for c, s, d in conn.execute(
                                "UPDATE asset_states a SET fencing_token = a.fencing_token + 1, input_hash = NULL,"
                                " updated_at = now() FROM unnest(%s::text[], %s::text[]) AS t(c, s)"
                                " WHERE a.book_id = %s AND a.stage = %s AND a.chapter_id = t.c AND a.scene_id = t.s"
                                " AND a.state = ANY(%s) RETURNING a.chapter_id, a.scene_id, a.dispatch_id",
                                (chapters, scene_ids, book, stage, values(rerun)),
                            ).fetchall()
                        ]
                    else:  # joined, but for a running job that is making media from other inputs than now
                        fenced = _fence_stale_runs(conn, book, stage, chapters, scene_ids)
                    if force:
                        # A target already queued (by a command without force) is taken the same way. After the
                        # fencing above: a takeover (or an unclaim) that moved a generating target to `pending`
                        # while these statements ran is seen here, once committed; before, neither statement
                        # matched it and it kept the hash of the media made before the reader asked for fresh.
                        conn.execute(
                            "UPDATE asset_states a SET input_hash = NULL FROM unnest(%s::text[], %s::text[]) AS t(c, s)"
                            " WHERE a.book_id = %s AND a.stage = %s AND a.chapter_id = t.c AND a.scene_id = t.s"
                            " AND a.state = %s AND a.input_hash IS NOT NULL",
                            (chapters, scene_ids, book, stage, AssetState.PENDING),
                        )
                    detail = {"command_id": command_id, "targets": len(scenes), "force": force, "rerun": len(fenced)}
                    journal.record(conn, "command.created", book, detail, stage=stage)
                    created.append(command_id)
                    superseded += fenced
        except psycopg.errors.UniqueViolation as err:
            raise DuplicateCommand(f"command id {request_id} was already used") from err
        except (psycopg.errors.NotNullViolation, psycopg.errors.ForeignKeyViolation) as err:
            # A named scene has no row (position) any more: an import removed it after the regenerate checked it.
            raise InvalidCommand(
                f"scenes: a scene named was removed from book {book!r} while the command was made; nothing was written"
            ) from err
        if sum(len(scenes) for _, scenes in per_stage.values()) >= ANALYZE_FROM_ROWS:
            self.db.analyze("command_targets")  # before the first pass joins the book's pairs to them
        return NewCommands(created, superseded, every)

    def command_statuses(self, command_ids: Sequence[str]) -> dict[str, str]:
        """Each command's status, by its key alone (`commands` counts the states of all its targets), once every
        commit before it is on disk: `create_commands` does not wait for its own flush. The read's transaction
        writes (an update of one of the commands that changes nothing), so its commit waits for the WAL up to it
        to be flushed, the commands' included: a transaction that only reads, or only takes a transaction id,
        waits for none. (A logical decoding message would do the same, but needs a privilege a hardened database
        may withhold.) One row only: updating them all locked them in key order, while a Stop All and a settle
        lock them in theirs, and a deadlock failed one side (a Stop All answered "postgres unavailable"); holding
        one row and waiting for no other, the read can be in no cycle."""
        if not command_ids:
            return {}
        ids = sorted(command_ids)
        with self.db.transaction() as conn, conn.pipeline():
            conn.execute("UPDATE commands SET updated_at = updated_at WHERE command_id = %s", (ids[0],))
            rows = conn.execute(
                "SELECT command_id, status FROM commands WHERE command_id = ANY(%s::uuid[])", (ids,)
            ).fetchall()
        return {str(cid): status for cid, status in rows}

    def commands(
        self,
        *,
        book: str | None = None,
        command_ids: Sequence[str] | None = None,
        limit: int = 200,
        every_active: bool = False,
    ) -> list[CommandRow]:
        """Commands with their per-state progress, newest first: the `limit` newest, and with `every_active` each
        one still active however old. The commands are chosen first, then their own targets read by key: chosen
        in the join's condition, every target ever kept was read and hashed against every pair (3.4 s at 8.9
        million targets) to list 200 commands."""
        params: list[Any] = [book] if book is not None else []
        where = "c.book_id = %s" if book is not None else "TRUE"
        if command_ids is not None:
            where += " AND c.command_id = ANY(%s::uuid[])"
            params.append(list(command_ids))
        with self.db.read() as conn:
            rows = conn.execute(
                f"WITH chosen AS MATERIALIZED ((SELECT command_id FROM commands c WHERE {where}"
                f"  ORDER BY created_at DESC LIMIT %s) UNION (SELECT command_id FROM commands c WHERE {where}"
                "  AND %s AND c.status = %s))"
                " SELECT c.command_id, c.book_id, c.stage, c.status, c.reason, extract(epoch FROM c.created_at),"
                " t.state, t.released, count(*) FROM chosen JOIN commands c ON c.command_id = chosen.command_id"
                " CROSS JOIN LATERAL (SELECT t.released, (SELECT a.state FROM asset_states a"
                "  WHERE a.book_id = t.book_id AND a.chapter_id = t.chapter_id AND a.scene_id = t.scene_id"
                "  AND a.stage = t.stage) AS state FROM command_targets t WHERE t.command_id = c.command_id OFFSET 0) t"
                " GROUP BY 1, 2, 3, 4, 5, 6, 7, 8 ORDER BY 6 DESC, 3",
                [*params, limit, *params, every_active, CommandStatus.ACTIVE],
            ).fetchall()
        found: dict[str, dict[str, Any]] = {}
        for cid, book_id, stage, status, reason, created, state, released, count in rows:
            entry = found.setdefault(
                str(cid),
                {
                    "book_id": book_id,
                    "stage": stage,
                    "status": status,
                    "reason": reason,
                    "created": float(created),
                    "progress": dict.fromkeys([s.value for s in AssetState], 0),
                    "released": {},
                },
            )
            entry["progress"][state or AssetState.DIRTY] += int(count)
            if released is not None:
                entry["released"][released] = entry["released"].get(released, 0) + int(count)
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
                e["released"],
            )
            for cid, e in found.items()
        ]

    def block_stage(self, book: str, stage: str, reason: str) -> tuple[list[str], list[tuple[Pair, str | None]]]:
        """Active commands of the stage -> blocked; their in-flight pairs -> dirty, and the targets
        released so marked with the reason (also those of a command created meanwhile, which then
        settles: it can no longer progress either).

        Returns (blocked command ids, released pairs with their dispatch ids).
        """
        with self.db.transaction() as conn:
            lock_book(conn, book)
            blocked = [
                str(r[0])
                for r in conn.execute(
                    "UPDATE commands SET status = %s, reason = %s, updated_at = now()"
                    " WHERE book_id = %s AND stage = %s AND status = %s RETURNING command_id",
                    (CommandStatus.BLOCKED, reason, book, stage, ACTIVE),
                )
            ]
            released = [((c, s, st), d) for c, s, st, d in _release_in_flight(conn, book, IN_FLIGHT, stage=stage)]
            release_targets(conn, book, [pair for pair, _ in released], reason, also=blocked)
            if blocked:
                journal.record(conn, "command.blocked", book, {"reason": reason, "commands": blocked}, stage=stage)
        return blocked, released

    def cancel_book(self, book: str, reason: str | None) -> tuple[list[str], int, list[tuple[Pair, str]]]:
        """Tombstone; active/blocked commands -> cancelled; in-flight pairs -> dirty.

        Returns (cancelled command ids, released pair count, the released pairs that were
        dispatched, with their dispatch ids: the only ones holding leases or queued jobs).
        """
        with self.db.transaction() as conn:
            lock_book(conn, book)  # a regenerate's commands and targets come in wholly before or after
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
            # One state at a time: what a released pair was is then known without a join (`_release_in_flight`).
            generating = _release_in_flight(conn, book, frozenset({AssetState.GENERATING}))
            dispatched = [((c, s, st), d) for c, s, st, d in generating if d]
            released = len(generating) + len(_release_in_flight(conn, book, frozenset({AssetState.PENDING})))
            detail = {"reason": reason, "commands": cancelled, "released": released}
            journal.record(conn, "book.cancelled", book, detail)
        return cancelled, released, dispatched

    def forced_in_flight(self, book: str, force_ttl: float, pairs: Sequence[Pair]) -> list[tuple[Pair, float]]:
        """Of `pairs`, those in flight whose newest active command is forced and younger than `force_ttl`, with the
        seconds left of that window: the force set, after a Redis loss. *Why of pairs:* read of the whole book by each
        page, a 100,000-pair book's pass read 2.2 million rows (5.9 s against 0.6) for a force window."""
        with self.db.read() as conn:
            rows = conn.execute(
                "SELECT DISTINCT ON (t.chapter_id, t.scene_id, t.stage) t.chapter_id, t.scene_id, t.stage, c.force,"
                " %s - extract(epoch FROM now() - c.created_at)"
                " FROM unnest(%s::text[], %s::text[], %s::text[]) AS u(chapter_id, scene_id, stage)"
                " JOIN command_targets t USING (chapter_id, scene_id, stage) JOIN commands c USING (command_id)"
                " JOIN asset_states a ON a.book_id = t.book_id AND a.chapter_id = t.chapter_id"
                "  AND a.scene_id = t.scene_id AND a.stage = t.stage"
                " WHERE t.book_id = %s AND c.book_id = %s AND c.status = %s AND a.state = ANY(%s)"
                " ORDER BY t.chapter_id, t.scene_id, t.stage, c.created_at DESC",
                (force_ttl, *pair_columns(pairs), book, book, ACTIVE, values(IN_FLIGHT)),
            ).fetchall()
        return [((c, s, st), float(left)) for c, s, st, force, left in rows if force and left > 0]

    def tombstoned_books(self) -> list[str]:
        """Those a job could still run or be dispatched for, whose flags reconcile keeps: with work, or stopped within
        a queued message's life. *Why:* every tombstone ever had its flag written again every 30 s, for good."""
        with self.db.read() as conn:
            return [r[0] for r in conn.execute(_FLAG_KEPT, (liveness.UNDELIVERED_MARKER_SECONDS,))]

    def is_tombstoned(self, book: str) -> bool:
        with self.db.read() as conn:
            return conn.execute("SELECT 1 FROM cancel_tombstones WHERE book_id = %s", (book,)).fetchone() is not None

    def books_with_work(self) -> dict[str, int]:
        """Books with an active command or an in-flight pair, with their pairs in flight: the ones reconcile
        looks at, and what a pass of each costs."""
        with self.db.read() as conn:
            rows = conn.execute(
                "SELECT book_id, sum(n)::bigint FROM (SELECT book_id, 0 AS n FROM commands WHERE status = %s"
                " UNION ALL SELECT book_id, count(*) FROM asset_states WHERE state = ANY(%s) GROUP BY book_id) w"
                " GROUP BY book_id",
                (ACTIVE, values(IN_FLIGHT)),
            ).fetchall()
        return {book: int(n) for book, n in rows}

    def prune_commands(self, retention_days: float, targets: int) -> int:
        """Delete the requests whose every command is over (`PRUNABLE`) and unchanged for `retention_days`, oldest
        first, with their commands and targets: as many as fit in `targets` target rows (one request at least), a
        backlog of whole-book commands a slice per call. Past the retention a resend of a `command_id` makes new
        commands. A request goes whole: with some of its commands pruned, a resend found the others only, and
        answered that the stages of those pruned had their layer off. How many commands were deleted."""
        ended, over, cutoff = literals.ENDED_STATUSES, _PRUNABLE, "now() - make_interval(secs => %(keep)s)"
        with self.db.transaction() as conn:  # the ended read by migration 0008's index, the BLOCKED (few) by a scan
            return conn.execute(
                "DELETE FROM commands WHERE request_id IN (SELECT request_id FROM"
                " (SELECT request_id, sum(coalesce(target_count, 1)) OVER (ORDER BY updated_at, command_id)"
                f"  - coalesce(target_count, 1) AS older FROM (SELECT * FROM commands WHERE status IN {ended}"
                f"  AND updated_at < {cutoff} UNION ALL SELECT * FROM commands WHERE status = {_BLOCKED}"
                f"  AND updated_at < {cutoff}) c"
                "  WHERE NOT EXISTS (SELECT 1 FROM commands o WHERE o.request_id = c.request_id"
                f"   AND (o.status NOT IN {over} OR o.updated_at >= {cutoff}))"
                "  ORDER BY updated_at, command_id LIMIT %(targets)s) p WHERE older < %(targets)s)",
                {"keep": retention_days * 86400, "targets": targets},
            ).rowcount


def _fence_stale_runs(
    conn: psycopg.Connection[Any], book: str, stage: str, chapters: list[str], scene_ids: list[str]
) -> list[tuple[Pair, str | None]]:
    """The targets whose running job started from other inputs than their scene's now (a re-import changed them
    meanwhile), fenced off as a forced regenerate fences them: joined, that job's commit completed the new command
    with media made from the old text. A start an older version recorded (its dispatch not the one the hash was
    read for) is joined, as before."""
    return [
        ((c, s, stage), d)
        for c, s, d in conn.execute(
            "UPDATE asset_states a SET fencing_token = a.fencing_token + 1, updated_at = now()"
            " FROM unnest(%s::text[], %s::text[]) AS t(c, s), scenes sc, job_starts j"
            " WHERE a.book_id = %s AND a.stage = %s AND a.chapter_id = t.c AND a.scene_id = t.s AND a.state = %s"
            " AND sc.book_id = a.book_id AND sc.chapter_id = a.chapter_id AND sc.scene_id = a.scene_id"
            " AND j.book_id = a.book_id AND j.chapter_id = a.chapter_id AND j.scene_id = a.scene_id"
            " AND j.stage = a.stage AND j.input_dispatch = a.dispatch_id AND j.input_hash IS NOT NULL"
            " AND j.input_hash IS DISTINCT FROM sc.input_hashes ->> a.stage"
            " RETURNING a.chapter_id, a.scene_id, a.dispatch_id",
            (chapters, scene_ids, book, stage, AssetState.GENERATING),
        ).fetchall()
    ]


def _release_in_flight(
    conn: psycopg.Connection[Any], book: str, states: frozenset[AssetState], *, stage: str | None = None
) -> list[tuple[str, str, str, Any]]:
    """The book's pairs in `states` (of `stage`, else of every stage) to dirty, as (chapter, scene, stage, dispatch
    id); the release leaves `dispatch_id` as it was. One table, no join: the join of the table to itself these
    releases made (to return what a pair was), planned on statistics that had not seen the book's pairs in
    flight (an estimate of one row), was a nested loop that read the book's in-flight pairs once per pair: a Stop
    All of 4,000 pairs took 1 s (quadratic in the pairs)."""
    of_stage = "" if stage is None else " AND stage = %(stage)s"
    return [
        (c, s, st, d)
        for c, s, st, d in conn.execute(
            "UPDATE asset_states SET state = %(dirty)s, updated_at = now()"
            f" WHERE book_id = %(book)s AND state = ANY(%(states)s){of_stage}"
            " RETURNING chapter_id, scene_id, stage, dispatch_id",
            {"dirty": AssetState.DIRTY, "book": book, "states": values(states), "stage": stage},
        )
    ]
