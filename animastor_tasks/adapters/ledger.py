"""Commands, asset states, fencing tokens, artifacts, tombstones and the journal in Postgres.

Every state change is compare-and-set: the `WHERE` names the state (and for a job,
the fencing token) the change expects, and a row that moved on is left alone and
reported as not changed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.domain.fsm import AssetState, sources_of, transition
from animastor_tasks.domain.gate import layer_enabled, parse_layers

Pair = tuple[str, str, str]  # (chapter, scene, stage)


@dataclass(frozen=True)
class CommandRow:
    command_id: str
    book_id: str
    stage: str
    status: str
    reason: str | None
    targets: int
    created_at: float
    progress: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A pending or generating pair as a gate pass sees it."""

    chapter: str
    scene: str
    stage: str
    state: str
    token: int
    position: int
    dispatch_id: str | None
    ready_hash: str | None  # hash of the inputs of the last committed artifact
    current_hash: str | None  # hash of the scene's current inputs
    has_artifact: bool
    commanded: bool  # an active command of this stage targets the scene


@dataclass(frozen=True)
class GateRows:
    layers_raw: str | None
    tombstone: bool
    commanded: frozenset[Pair]  # in-flight pairs an active command targets
    in_flight: tuple[InFlight, ...]


@dataclass(frozen=True)
class Claim:
    """A pair moved pending -> generating under a new token and dispatch id."""

    chapter: str
    scene: str
    stage: str
    token: int
    dispatch_id: str


@dataclass(frozen=True)
class JobCheck:
    ok: bool
    reason: str
    text: str = ""
    prompt: str = ""


def _pairs_arrays(book: str, pairs: Sequence[Pair]) -> tuple[str, list[str], list[str], list[str]]:
    return book, [p[0] for p in pairs], [p[1] for p in pairs], [p[2] for p in pairs]


_PAIRS_CTE = "WITH p(chapter_id, scene_id, stage) AS (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))"


class Ledger:
    def __init__(self, db: Database) -> None:
        self.db = db

    # -- commands -----------------------------------------------------------------------
    def commands_for_request(self, request_id: str) -> list[CommandRow]:
        with self.db.read() as conn:
            ids = [r[0] for r in conn.execute("SELECT command_id FROM commands WHERE request_id = %s", (request_id,))]
        return self.commands(command_ids=[str(i) for i in ids]) if ids else []

    def create_commands(
        self,
        book: str,
        request_id: str,
        per_stage: dict[str, tuple[str, list[tuple[str, str]]]],
        force: bool,
    ) -> list[str]:
        """Commands (active) + targets + targets to `pending`, in one transaction.

        `per_stage` maps stage -> (command_id, [(chapter, scene)]). A pair already
        `generating` is left alone: the running job completes it for the new command.
        """
        created: list[str] = []
        # Pipeline mode: the statements below need no answer from each other, so they travel
        # to the server together instead of one round trip each.
        with self.db.transaction() as conn, conn.pipeline():
            conn.execute("DELETE FROM cancel_tombstones WHERE book_id = %s", (book,))
            for stage, (command_id, scenes) in per_stage.items():
                conn.execute(
                    "INSERT INTO commands (command_id, book_id, stage, status, force, request_id)"
                    " VALUES (%s, %s, %s, 'active', %s, %s)",
                    (command_id, book, stage, force, request_id),
                )
                chapters = [c for c, _ in scenes]
                scene_ids = [s for _, s in scenes]
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
                    "UPDATE asset_states a SET state = 'pending', error = NULL, updated_at = now()"
                    " FROM unnest(%s::text[], %s::text[]) AS t(c, s)"
                    " WHERE a.book_id = %s AND a.stage = %s AND a.chapter_id = t.c AND a.scene_id = t.s"
                    " AND a.state = ANY(%s)",
                    (chapters, scene_ids, book, stage, [str(s) for s in sources_of(AssetState.PENDING)]),
                )
                conn.execute(
                    "INSERT INTO events (kind, book_id, stage, detail) VALUES ('command.created', %s, %s, %s)",
                    (book, stage, Jsonb({"command_id": command_id, "targets": len(scenes), "force": force})),
                )
                created.append(command_id)
        return created

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
            entry["progress"][state or "dirty"] += int(count)
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

    # -- gate facts ---------------------------------------------------------------------
    def gate_rows(self, book: str) -> GateRows | None:
        """Everything a gate pass needs from Postgres, in one statement; None for an unknown book.

        Only in-flight pairs are read, each flagged with whether an active command targets it:
        idle pairs and the targets of finished work cost nothing.
        """
        with self.db.read() as conn:
            rows = conn.execute(
                "WITH active AS (SELECT DISTINCT t.chapter_id, t.scene_id, t.stage FROM commands c"
                "  JOIN command_targets t ON t.command_id = c.command_id"
                "  WHERE c.book_id = %(book)s AND c.status = 'active'),"
                " flight AS (SELECT a.chapter_id, a.scene_id, a.stage, a.state, a.fencing_token, s.position,"
                "  a.dispatch_id, a.input_hash, s.input_hashes ->> a.stage AS current_hash,"
                "  a.artifact_sha256 IS NOT NULL AS has_artifact, act.stage IS NOT NULL AS commanded"
                "  FROM asset_states a JOIN scenes s ON s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
                "   AND s.scene_id = a.scene_id"
                "  LEFT JOIN active act ON act.chapter_id = a.chapter_id AND act.scene_id = a.scene_id"
                "   AND act.stage = a.stage"
                "  WHERE a.book_id = %(book)s AND a.state IN ('pending', 'generating'))"
                # The book's own row comes first (position -1) and carries the layers and the tombstone.
                " SELECT NULL, NULL, NULL, NULL, 0, -1, b.layer_config, NULL, NULL, false,"
                "  EXISTS (SELECT 1 FROM cancel_tombstones t WHERE t.book_id = b.book_id)"
                " FROM books b WHERE b.book_id = %(book)s"
                " UNION ALL SELECT * FROM flight ORDER BY 6",
                {"book": book},
            ).fetchall()
        if not rows or rows[0][5] != -1:
            return None
        head, body = rows[0], rows[1:]
        in_flight = tuple(InFlight(*row) for row in body)
        layers_raw, tombstone = head[6], bool(head[10])
        commanded = frozenset((i.chapter, i.scene, i.stage) for i in in_flight if i.commanded)
        return GateRows(layers_raw, tombstone, commanded, in_flight)

    def move_pairs(
        self, book: str, pairs: Sequence[Pair], source: AssetState, target: AssetState, event: str
    ) -> list[Pair]:
        """Compare-and-set many pairs `source -> target`; the pairs that really moved.

        The edge is checked against the FSM first (`InvalidTransition`); a pair no longer in
        `source` is left alone and simply missing from the answer.
        """
        transition(source, target)
        if not pairs:
            return []
        with self.db.transaction() as conn:
            moved = self._move(conn, book, pairs, source, target)
            if moved:
                conn.execute(
                    "INSERT INTO events (kind, book_id, detail) VALUES (%s, %s, %s)",
                    (event, book, Jsonb({"pairs": len(moved), "from": source, "to": target})),
                )
        return moved

    @staticmethod
    def _move(
        conn: psycopg.Connection, book: str, pairs: Sequence[Pair], source: AssetState, target: AssetState
    ) -> list[Pair]:
        rows = conn.execute(
            _PAIRS_CTE + " UPDATE asset_states a SET state = %s, updated_at = now() FROM p"
            " WHERE a.book_id = %s AND a.chapter_id = p.chapter_id AND a.scene_id = p.scene_id"
            " AND a.stage = p.stage AND a.state = %s RETURNING a.chapter_id, a.scene_id, a.stage",
            (*_pairs_arrays(book, pairs)[1:], str(target), book, str(source)),
        ).fetchall()
        return [tuple(r) for r in rows]

    # -- dispatch ---------------------------------------------------------------------------
    def claim(
        self,
        book: str,
        wanted: Sequence[tuple[Pair, str]],
        queue_lanes: dict[str, str],
        choose: Callable[[dict[str, Any]], Sequence[tuple[Pair, str]]],
        before_commit: Callable[[list[Claim]], None],
    ) -> list[Claim]:
        """Move chosen pending pairs to `generating` under queue locks and exact capacity counts.

        `choose(counts)` receives the in-transaction counts and returns the subset of
        `wanted` (pair, dispatch id) to claim; it runs while the lane locks are held, so
        two concurrent passes can never overfill a lane or claim one pair twice.
        `before_commit(claims)` takes the leases and records capacity deferrals while the
        lane locks are held (a completion takes the same lock before it frees capacity,
        so a deferral can never be written after the completion that should clear it);
        if it fails, nothing is claimed.
        """
        stages = sorted({pair[2] for pair, _ in wanted})
        # Lanes first (sorted), then the book: completions take their lane, then the book,
        # so the order is the same everywhere. The scene window spans stages, hence the book lock.
        locks = [*(f"lane:{queue_lanes[stage]}" for stage in stages), f"book:{book}"]
        with self.db.transaction() as conn, conn.pipeline():
            # Pipeline mode: BEGIN, the locks and the counts reach the server in one round trip.
            conn.execute(
                "SELECT pg_advisory_xact_lock(hashtext(k)) FROM unnest(%s::text[]) WITH ORDINALITY AS l(k, n)"
                " ORDER BY n",
                (locks,),
            )
            counts = self._capacity_counts(conn, book, stages)
            chosen: Sequence[tuple[Pair, str]] = choose(counts)
            claims: list[Claim] = []
            if chosen:
                # The claim and its journal event in one statement.
                rows = conn.execute(
                    "WITH p(chapter_id, scene_id, stage, dispatch_id) AS"
                    " (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[])),"
                    " claimed AS (UPDATE asset_states a SET state = 'generating', fencing_token = a.fencing_token + 1,"
                    "  dispatch_id = p.dispatch_id, updated_at = now() FROM p"
                    "  WHERE a.book_id = %s AND a.chapter_id = p.chapter_id AND a.scene_id = p.scene_id"
                    "  AND a.stage = p.stage AND a.state = 'pending'"
                    "  RETURNING a.chapter_id, a.scene_id, a.stage, a.fencing_token, a.dispatch_id),"
                    " journal AS (INSERT INTO events (kind, book_id, chapter_id, scene_id, stage, dispatch_id, detail)"
                    "  SELECT 'dispatch', %s, chapter_id, scene_id, stage, dispatch_id,"
                    "  jsonb_build_object('token', fencing_token) FROM claimed)"
                    " SELECT chapter_id, scene_id, stage, fencing_token, dispatch_id FROM claimed",
                    (
                        [p[0] for p, _ in chosen],
                        [p[1] for p, _ in chosen],
                        [p[2] for p, _ in chosen],
                        [d for _, d in chosen],
                        book,
                        book,
                    ),
                ).fetchall()
                claims = [Claim(*row) for row in rows]
            before_commit(claims)
        return claims

    @staticmethod
    def _capacity_counts(conn: psycopg.Connection, book: str, stages: list[str]) -> dict[str, Any]:
        """Generating pairs per lane and the book's own generating pairs, in one query."""
        rows = conn.execute(
            "SELECT stage, NULL, NULL, count(*) FROM asset_states WHERE state = 'generating' AND stage = ANY(%s)"
            " GROUP BY stage"
            " UNION ALL SELECT stage, chapter_id, scene_id, NULL FROM asset_states"
            " WHERE book_id = %s AND state = 'generating'",
            (stages, book),
        ).fetchall()
        lane = {stage: int(n) for stage, chapter, _, n in rows if chapter is None}
        mine = [(chapter, scene, stage) for stage, chapter, scene, n in rows if chapter is not None]
        return {"lane": lane, "book_generating": mine}

    def unclaim(self, book: str, claims: Sequence[Claim]) -> int:
        """Undo claims whose job could not be published: `generating -> pending` if the token is still ours."""
        if not claims:
            return 0
        with self.db.transaction() as conn:
            return conn.execute(
                "UPDATE asset_states a SET state = 'pending', dispatch_id = NULL, updated_at = now()"
                " FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[]) AS u(c, s, st, t)"
                " WHERE a.book_id = %s AND a.chapter_id = u.c AND a.scene_id = u.s AND a.stage = u.st"
                " AND a.state = 'generating' AND a.fencing_token = u.t",
                (
                    [c.chapter for c in claims],
                    [c.scene for c in claims],
                    [c.stage for c in claims],
                    [c.token for c in claims],
                    book,
                ),
            ).rowcount

    def mark_already_completed(self, book: str, pairs: Sequence[Pair]) -> list[Pair]:
        """`pending -> ready` for pairs whose committed artifact already has the current inputs."""
        if not pairs:
            return []
        with self.db.transaction() as conn:
            rows = conn.execute(
                _PAIRS_CTE + " UPDATE asset_states a SET state = 'ready', updated_at = now() FROM p, scenes s"
                " WHERE a.book_id = %s AND a.chapter_id = p.chapter_id AND a.scene_id = p.scene_id"
                " AND a.stage = p.stage AND a.state = 'pending' AND a.artifact_sha256 IS NOT NULL"
                " AND s.book_id = a.book_id AND s.chapter_id = a.chapter_id AND s.scene_id = a.scene_id"
                " AND a.input_hash = s.input_hashes ->> a.stage RETURNING a.chapter_id, a.scene_id, a.stage",
                (*_pairs_arrays(book, pairs)[1:], book),
            ).fetchall()
            self._settle_commands(conn, book)
        return [tuple(r) for r in rows]

    # -- blocked / cancel -------------------------------------------------------------------
    def block_stage(self, book: str, stage: str, reason: str) -> tuple[list[str], list[tuple[Pair, str | None]]]:
        """Active commands of the stage -> blocked; their in-flight pairs -> dirty.

        Returns (blocked command ids, released pairs with their dispatch ids).
        """
        with self.db.transaction() as conn:
            blocked = [
                str(r[0])
                for r in conn.execute(
                    "UPDATE commands SET status = 'blocked', reason = %s, updated_at = now()"
                    " WHERE book_id = %s AND stage = %s AND status = 'active' RETURNING command_id",
                    (reason, book, stage),
                )
            ]
            released = [
                ((c, s, stage), d)
                for c, s, d in conn.execute(
                    "UPDATE asset_states a SET state = 'dirty', updated_at = now()"
                    " FROM (SELECT chapter_id, scene_id, dispatch_id AS old_dispatch FROM asset_states"
                    "  WHERE book_id = %s AND stage = %s AND state IN ('pending', 'generating') FOR UPDATE) o"
                    " WHERE a.book_id = %s AND a.stage = %s AND a.chapter_id = o.chapter_id"
                    " AND a.scene_id = o.scene_id AND a.state IN ('pending', 'generating')"
                    " RETURNING a.chapter_id, a.scene_id, o.old_dispatch",
                    (book, stage, book, stage),
                )
            ]
            if blocked:
                conn.execute(
                    "INSERT INTO events (kind, book_id, stage, detail) VALUES ('command.blocked', %s, %s, %s)",
                    (book, stage, Jsonb({"reason": reason, "commands": blocked})),
                )
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
                    "UPDATE commands SET status = 'cancelled', reason = %s, updated_at = now()"
                    " WHERE book_id = %s AND status IN ('active', 'blocked') RETURNING command_id",
                    (reason or "cancelled", book),
                )
            ]
            rows = conn.execute(
                "UPDATE asset_states a SET state = 'dirty', updated_at = now()"
                " FROM (SELECT chapter_id, scene_id, stage, state AS old_state, dispatch_id AS old_dispatch"
                "  FROM asset_states WHERE book_id = %s AND state IN ('pending', 'generating') FOR UPDATE) o"
                " WHERE a.book_id = %s AND a.chapter_id = o.chapter_id AND a.scene_id = o.scene_id"
                " AND a.stage = o.stage AND a.state IN ('pending', 'generating')"
                " RETURNING a.chapter_id, a.scene_id, a.stage, o.old_state, o.old_dispatch",
                (book, book),
            ).fetchall()
            dispatched = [((c, s, st), d) for c, s, st, old, d in rows if old == "generating" and d]
            conn.execute(
                "INSERT INTO events (kind, book_id, detail) VALUES ('book.cancelled', %s, %s)",
                (book, Jsonb({"reason": reason, "commands": cancelled, "released": len(rows)})),
            )
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
                " WHERE c.book_id = %s AND c.status = 'active' AND a.state IN ('pending', 'generating')"
                " ORDER BY t.chapter_id, t.scene_id, t.stage, c.created_at DESC",
                (force_ttl, book),
            ).fetchall()
        return [((c, s, st), float(left)) for c, s, st, force, left in rows if force and left > 0]

    def tombstoned_books(self) -> list[str]:
        with self.db.read() as conn:
            return [r[0] for r in conn.execute("SELECT book_id FROM cancel_tombstones")]

    def is_tombstoned(self, book: str) -> bool:
        with self.db.read() as conn:
            return conn.execute("SELECT 1 FROM cancel_tombstones WHERE book_id = %s", (book,)).fetchone() is not None

    # -- jobs -----------------------------------------------------------------------------------
    def start_job(self, book: str, pair: Pair, token: int, dispatch_id: str) -> JobCheck:
        """The gate and the fencing token, checked and the start recorded in one transaction.

        The row lock serializes the start with a concurrent cancel: either the start
        commits first (and the job will see the cancel through `should_stop`), or the
        cancel does and this check fails.
        """
        chapter, scene, stage = pair
        with self.db.transaction() as conn:
            row = conn.execute(
                "SELECT a.state, a.fencing_token, a.dispatch_id, s.text, s.prompt,"
                " EXISTS (SELECT 1 FROM cancel_tombstones t WHERE t.book_id = a.book_id),"
                " EXISTS (SELECT 1 FROM commands c JOIN command_targets ct ON ct.command_id = c.command_id"
                "  WHERE c.book_id = a.book_id AND c.status = 'active' AND ct.chapter_id = a.chapter_id"
                "  AND ct.scene_id = a.scene_id AND ct.stage = a.stage),"
                " b.layer_config"
                " FROM asset_states a JOIN scenes s ON s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
                "  AND s.scene_id = a.scene_id JOIN books b ON b.book_id = a.book_id"
                " WHERE a.book_id = %s AND a.chapter_id = %s AND a.scene_id = %s AND a.stage = %s FOR UPDATE OF a",
                (book, chapter, scene, stage),
            ).fetchone()
            if row is None:
                return JobCheck(False, "unknown_pair")
            state, current, owner, text, prompt, tombstone, commanded, layers = row
            if tombstone:
                return JobCheck(False, "cancelled")
            if state != "generating" or current != token or owner != dispatch_id:
                return JobCheck(False, "stale_token")
            if not commanded:
                return JobCheck(False, "no_active_task")
            if not layer_enabled(parse_layers(layers), stage):
                return JobCheck(False, "layer_disabled")
            conn.execute(
                "INSERT INTO events (kind, book_id, chapter_id, scene_id, stage, dispatch_id, detail)"
                " VALUES ('job.started', %s, %s, %s, %s, %s, %s)",
                (book, chapter, scene, stage, dispatch_id, Jsonb({"token": token})),
            )
        return JobCheck(True, "ok", text, prompt)

    def commit_job(
        self,
        book: str,
        pair: Pair,
        token: int,
        dispatch_id: str,
        artifact: dict[str, Any],
        lane: str,
    ) -> bool:
        """`generating -> ready` + the artifact row, only if the token is still current."""
        chapter, scene, stage = pair
        with self.db.transaction() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"lane:{lane}",))
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"book:{book}",))
            done = conn.execute(
                "UPDATE asset_states a SET state = 'ready', artifact_sha256 = %s,"
                " input_hash = s.input_hashes ->> a.stage, error = NULL, updated_at = now() FROM scenes s"
                " WHERE a.book_id = %s AND a.chapter_id = %s AND a.scene_id = %s AND a.stage = %s"
                " AND a.state = 'generating' AND a.fencing_token = %s AND a.dispatch_id = %s"
                " AND s.book_id = a.book_id AND s.chapter_id = a.chapter_id AND s.scene_id = a.scene_id",
                (artifact["sha256"], book, chapter, scene, stage, token, dispatch_id),
            ).rowcount
            if not done:
                return False
            conn.execute(
                "INSERT INTO artifacts (sha256, size_bytes, media_type, book_id, chapter_id, scene_id, stage,"
                " fencing_token, dispatch_id, generator, duration_ms, path)"
                " VALUES (%(sha256)s, %(size)s, %(media_type)s, %(book)s, %(chapter)s, %(scene)s, %(stage)s,"
                " %(token)s, %(dispatch_id)s, %(generator)s, %(duration_ms)s, %(path)s)",
                {
                    **artifact,
                    "book": book,
                    "chapter": chapter,
                    "scene": scene,
                    "stage": stage,
                    "token": token,
                    "dispatch_id": dispatch_id,
                },
            )
            conn.execute(
                "INSERT INTO events (kind, book_id, chapter_id, scene_id, stage, dispatch_id, detail)"
                " VALUES ('job.ready', %s, %s, %s, %s, %s, %s)",
                (book, chapter, scene, stage, dispatch_id, Jsonb({"token": token, "sha256": artifact["sha256"]})),
            )
            self._settle_commands(conn, book)
        return True

    def fail_job(self, book: str, pair: Pair, token: int, dispatch_id: str, error: str, lane: str) -> bool:
        chapter, scene, stage = pair
        with self.db.transaction() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"lane:{lane}",))
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"book:{book}",))
            done = conn.execute(
                "UPDATE asset_states SET state = 'failed', error = %s, updated_at = now()"
                " WHERE book_id = %s AND chapter_id = %s AND scene_id = %s AND stage = %s"
                " AND state = 'generating' AND fencing_token = %s AND dispatch_id = %s",
                (error[:4000], book, chapter, scene, stage, token, dispatch_id),
            ).rowcount
            if done:
                conn.execute(
                    "INSERT INTO events (kind, book_id, chapter_id, scene_id, stage, dispatch_id, detail)"
                    " VALUES ('job.failed', %s, %s, %s, %s, %s, %s)",
                    (book, chapter, scene, stage, dispatch_id, Jsonb({"error": error[:1000]})),
                )
                self._settle_commands(conn, book)
        return bool(done)

    def token_is_current(self, book: str, pair: Pair, token: int, dispatch_id: str) -> bool:
        chapter, scene, stage = pair
        with self.db.read() as conn:
            return (
                conn.execute(
                    "SELECT 1 FROM asset_states WHERE book_id = %s AND chapter_id = %s AND scene_id = %s"
                    " AND stage = %s AND state = 'generating' AND fencing_token = %s AND dispatch_id = %s",
                    (book, chapter, scene, stage, token, dispatch_id),
                ).fetchone()
                is not None
            )

    @staticmethod
    def _settle_commands(conn: psycopg.Connection, book: str) -> None:
        """Active commands whose targets are all terminal become completed (or failed)."""
        conn.execute(
            "UPDATE commands c SET status = CASE WHEN x.failed > 0 THEN 'failed' ELSE 'completed' END,"
            " reason = CASE WHEN x.failed > 0 THEN x.failed || ' of ' || x.total || ' targets failed' END,"
            " updated_at = now()"
            " FROM (SELECT t.command_id, count(*) AS total,"
            "  count(*) FILTER (WHERE a.state = 'failed') AS failed,"
            "  count(*) FILTER (WHERE a.state IS NULL OR a.state NOT IN ('ready', 'failed')) AS open"
            "  FROM commands c2 JOIN command_targets t ON t.command_id = c2.command_id"
            "  LEFT JOIN asset_states a ON a.book_id = t.book_id AND a.chapter_id = t.chapter_id"
            "   AND a.scene_id = t.scene_id AND a.stage = t.stage"
            "  WHERE c2.book_id = %s AND c2.status = 'active' GROUP BY t.command_id) x"
            " WHERE c.command_id = x.command_id AND x.open = 0",
            (book,),
        )

    # -- reconcile ------------------------------------------------------------------------------
    def generating_pairs(self) -> list[tuple[str, str, str, str, int, str | None]]:
        """(book, chapter, scene, stage, token, dispatch id) of every generating pair."""
        with self.db.read() as conn:
            return [
                tuple(r)
                for r in conn.execute(
                    "SELECT book_id, chapter_id, scene_id, stage, fencing_token, dispatch_id FROM asset_states"
                    " WHERE state = 'generating'"
                )
            ]

    def books_with_work(self) -> list[str]:
        """Books with an active command or an in-flight pair: the ones reconcile looks at."""
        with self.db.read() as conn:
            return [
                r[0]
                for r in conn.execute(
                    "SELECT book_id FROM commands WHERE status = 'active'"
                    " UNION SELECT book_id FROM asset_states WHERE state IN ('pending', 'generating')"
                )
            ]

    def expire_generating(self, book: str, pair: Pair, token: int, target: AssetState) -> bool:
        transition(AssetState.GENERATING, target)
        chapter, scene, stage = pair
        with self.db.transaction() as conn:
            done = conn.execute(
                "UPDATE asset_states SET state = %s, dispatch_id = NULL, updated_at = now()"
                " WHERE book_id = %s AND chapter_id = %s AND scene_id = %s AND stage = %s"
                " AND state = 'generating' AND fencing_token = %s",
                (str(target), book, chapter, scene, stage, token),
            ).rowcount
            if done:
                conn.execute(
                    "INSERT INTO events (kind, book_id, chapter_id, scene_id, stage, detail)"
                    " VALUES ('lease.expired', %s, %s, %s, %s, %s)",
                    (book, chapter, scene, stage, Jsonb({"token": token, "to": str(target)})),
                )
        return bool(done)

    def prune_journal(self, retention_days: float, max_rows: int) -> int:
        with self.db.transaction() as conn:
            removed = conn.execute(
                "DELETE FROM events WHERE at < now() - make_interval(secs => %s)", (retention_days * 86400,)
            ).rowcount
            removed += conn.execute(
                "DELETE FROM events WHERE id <= (SELECT max(id) - %s FROM events)", (max_rows,)
            ).rowcount
        return removed

    # -- reads for operators ----------------------------------------------------------------------
    def scene_states(self, book: str) -> list[tuple[str, str, str, str, str | None]]:
        """(chapter, scene, stage, state, artifact sha256) for every pair, in reading order."""
        with self.db.read() as conn:
            return [
                tuple(r)
                for r in conn.execute(
                    "SELECT a.chapter_id, a.scene_id, a.stage, a.state, a.artifact_sha256 FROM asset_states a"
                    " JOIN scenes s ON s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
                    "  AND s.scene_id = a.scene_id WHERE a.book_id = %s ORDER BY s.position, a.stage",
                    (book,),
                )
            ]

    def lane_usage(self) -> dict[str, int]:
        with self.db.read() as conn:
            return dict(
                conn.execute(
                    "SELECT stage, count(*) FROM asset_states WHERE state = 'generating' GROUP BY stage"
                ).fetchall()
            )


def new_dispatch_id() -> str:
    """128 random bits: a dispatch id is never guessable nor reused."""
    return uuid.uuid4().hex
