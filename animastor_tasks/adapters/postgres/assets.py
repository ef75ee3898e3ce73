"""Asset states of scene x stage pairs: the gate's facts, compare-and-set moves, the claim.

Every change is compare-and-set: the `WHERE` names the state (and for a job, the
fencing token) the change expects; a row that moved on is left alone and reported as
not changed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from animastor_tasks.adapters.postgres import journal, literals
from animastor_tasks.adapters.postgres.gate_reads import GateReads, pair_columns, rows_of_pairs
from animastor_tasks.adapters.postgres.locks import lock_book
from animastor_tasks.adapters.postgres.pool import BOOK_BUSY_WAIT_MS, LANE_HOLDERS, LOCK_WAIT_MS, bound_lock_waits
from animastor_tasks.adapters.postgres.released import release_targets, released_pending
from animastor_tasks.adapters.postgres.settle import settle_commands
from animastor_tasks.domain.capacity import CapacityCounts, Waiter
from animastor_tasks.domain.gate import BookFacts, decide, decide_all
from animastor_tasks.domain.keys import claim_locks
from animastor_tasks.domain.types import BookPair, Pair
from animastor_tasks.domain.vocabulary import (
    AssetState,
    transition,
)
from animastor_tasks.errors import BookBusy, StoreUnavailable
from animastor_tasks.ports import Claim, GateRows, GeneratingRow

_PAIRS_CTE = "WITH p(chapter_id, scene_id, stage) AS (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))"


def new_dispatch_id() -> str:
    """128 random bits: a dispatch id is never guessable nor reused."""
    return uuid.uuid4().hex


class ClaimTransaction:
    """The open claim transaction of `AssetStore.claiming`: counts read, locks held."""

    def __init__(self, conn: psycopg.Connection[Any], book: str, counts: CapacityCounts) -> None:
        self._conn, self._book, self.counts = conn, book, counts

    def claim(self, chosen: Sequence[tuple[Pair, str]]) -> list[Claim]:
        """`pending -> generating` with the next token and the given dispatch ids, journalled, in one statement."""
        if not chosen:
            return []
        chapters, scenes, stages = pair_columns([pair for pair, _ in chosen])
        rows = self._conn.execute(
            "WITH p(chapter_id, scene_id, stage, dispatch_id) AS"
            " (SELECT * FROM unnest(%(chapters)s::text[], %(scenes)s::text[], %(stages)s::text[], %(ids)s::text[])),"
            " changed AS (UPDATE asset_states a SET state = %(generating)s, fencing_token = a.fencing_token + 1,"
            "  dispatch_id = p.dispatch_id, updated_at = now() FROM p"
            "  WHERE a.book_id = %(book)s AND a.chapter_id = p.chapter_id AND a.scene_id = p.scene_id"
            f"  AND a.stage = p.stage AND a.state = {literals.PENDING}"
            "  RETURNING a.chapter_id, a.scene_id, a.stage, a.fencing_token, a.dispatch_id),"
            + journal.EVENTS_FROM_CHANGED
            + " SELECT chapter_id, scene_id, stage, fencing_token, dispatch_id FROM changed",
            {
                "chapters": chapters,
                "scenes": scenes,
                "stages": stages,
                "ids": [d for _, d in chosen],
                "generating": AssetState.GENERATING,
                "book": self._book,
                "kind": "dispatch",
            },
        ).fetchall()
        return [Claim(*row) for row in rows]


def _facts_now(
    conn: psycopg.Connection[Any], book: str, pairs: Sequence[Pair], stop_stands: Callable[[], bool] | None = None
) -> tuple[GateRows, BookFacts] | None:
    """The pairs' rows and the book's gate facts as Postgres has them now, under the caller's book lock; None for a
    book that is gone. The Redis flag counts only where the caller saw one and no tombstone stands: `stop_stands()`
    is then asked here, under the lock (a round trip waited for on this rare path alone), whether it still stops
    the book. A regenerate's commands come wholly before or after, and it lifts the flag before them."""
    rows = rows_of_pairs(conn, book, pairs)
    if rows is None:
        return None
    flagged = not rows.tombstone and stop_stands is not None and stop_stands()
    return rows, BookFacts(True, flagged, rows.tombstone, rows.layers_raw, rows.commanded)


class AssetStore(GateReads):
    """The moves and the claim; the gate's reads are `GateReads`'."""

    def release_denied(
        self, book: str, pairs: Sequence[Pair], stop_stands: Callable[[], bool] | None = None
    ) -> list[Pair]:
        """Of `pairs`, those the gate denies now, `pending -> dirty`: judged under the book's lock on the facts of this
        moment (`_facts_now`; `stop_stands` where the caller saw a cancel flag). *Why:* judged on the pass's facts, a
        Stop All and a new regenerate between the pass's read and its release had it release the new command's pairs
        on the old flag, no target of the command marked released, and the command stayed active for ever; judged on
        Postgres's alone, the pairs of a Stop All whose Postgres half failed stayed `pending` under its flag."""
        if not pairs:
            return []
        wanted = set(pairs)
        with self.db.transaction() as conn:
            lock_book(conn, book, soon=True)  # a regenerate's commands and a Stop All come wholly before or after
            found = _facts_now(conn, book, pairs, stop_stands)
            if found is None:
                return []
            rows, facts = found
            _, denied = decide_all(
                facts, [i for i in rows.in_flight if i.pair in wanted and i.state == AssetState.PENDING]
            )
            still = [pair for pair in pairs if pair in denied]
            return _release(conn, book, still) if still else []

    @contextmanager
    def claiming(
        self,
        book: str,
        lanes: Mapping[str, str],
        waiters: Mapping[str, Mapping[str, int]] | None = None,
        handed: Mapping[str, Mapping[str, int]] | None = None,
        ahead: Mapping[str, Collection[str]] | None = None,
    ) -> Iterator[ClaimTransaction]:
        """Open a claim: the lanes of `lanes` (stage -> queue) and the book locked, capacity counted.

        `waiters` (stage -> other books waiting for its lane -> the priority rank each waits at): their
        generating pairs are read in the same statement, so the fair share knows whether they are still
        below theirs; None: unknown. `handed` (the same shape): books handed a slot whose refills are on their way.
        `ahead` (stage -> books): those of `waiters` ahead of this book on the list, at the priority they wait at.
        The caller chooses from the counts (`domain.capacity`), claims, and writes its leases
        and deferrals before the block ends: a completion takes the same locks before it frees
        capacity, so a deferral can never land after the completion that should clear it.
        """
        stages = sorted(lanes)
        others = sorted({b for books in (*(waiters or {}).values(), *(handed or {}).values()) for b in books} - {book})
        [book_key, *lane_keys] = claim_locks(lanes.values(), book)
        counted = (
            f"SELECT stage, NULL, NULL, NULL, count(*) FROM asset_states WHERE state = {literals.GENERATING}"
            " AND stage = ANY(%(stages)s) GROUP BY stage"
            " UNION ALL SELECT stage, book_id, chapter_id, scene_id, NULL FROM asset_states"
            f" WHERE book_id = ANY(%(books)s) AND state = {literals.GENERATING}"
        )
        lock_lanes = (
            "SELECT pg_advisory_xact_lock(hashtext(k)) FROM unnest(%s::text[]) WITH ORDINALITY AS l(k, n) ORDER BY n"
        )
        with self.db.transaction() as conn, conn.pipeline():
            # Pipeline mode: BEGIN, the locks and the counts reach the server in one round trip.
            # The claim's commit does not wait for its WAL flush (about 1 ms here, on every dispatch's path): a job
            # runs only past its start check, whose synchronous commit flushes the WAL written before it, the
            # claim's included; a claim a crash loses is refused at that check, its pair still pending.
            conn.execute("SET LOCAL synchronous_commit = off")
            bound_lock_waits(conn)
            # The book's lock waited for `BOOK_BUSY_WAIT_MS` at most (a busy book: `LockNotAvailable`); the lanes'
            # for the usual bound, as a statement's time (`QueryCanceled`, a store's trouble): the pipeline's one
            # error says which it was. Then the usual lock bound for the claim's rows.
            conn.execute(f"SET LOCAL lock_timeout = {BOOK_BUSY_WAIT_MS}")
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (book_key,))
            conn.execute("SET LOCAL lock_timeout = 0")
            conn.execute(f"SET LOCAL statement_timeout = {LOCK_WAIT_MS}")
            conn.execute(lock_lanes, (lane_keys,))
            conn.execute("SET LOCAL statement_timeout = DEFAULT")
            conn.execute(f"SET LOCAL lock_timeout = {LOCK_WAIT_MS}")
            try:
                rows = conn.execute(counted, {"stages": stages, "books": [book, *others]}).fetchall()
            except psycopg.errors.LockNotAvailable as err:
                raise BookBusy(book, BOOK_BUSY_WAIT_MS / 1000) from err
            except psycopg.errors.QueryCanceled as err:  # the lanes' wait: said so (the error's words name no lock)
                queues = ", ".join(sorted(set(lanes.values())))
                held = f"the locks of lane(s) {queues} held past {LOCK_WAIT_MS / 1000:g}s"
                raise StoreUnavailable("postgres", self.db.url, f"{err} ({held} by {LANE_HOLDERS})") from err
            running: dict[str, list[Pair]] = {}
            for stage, owner, chapter, scene, _ in rows:
                if owner is not None:
                    running.setdefault(owner, []).append((chapter, scene, stage))
            counts = CapacityCounts(
                lane={stage: int(n) for stage, owner, _, _, n in rows if owner is None},
                book_generating=running.get(book, []),
                waiting=None
                if waiters is None
                else {
                    stage: [
                        Waiter(rank, running.get(b, []), ahead=b in (ahead or {}).get(stage, ()))
                        for b, rank in books.items()
                        if b != book
                    ]
                    + [
                        Waiter(r, running.get(b, []), handed=True, ahead=b in (ahead or {}).get(stage, ()))
                        for b, r in (handed or {}).get(stage, {}).items()
                    ]
                    for stage, books in waiters.items()
                },
            )
            yield ClaimTransaction(conn, book, counts)

    def lane_load(self, stages: Sequence[str]) -> dict[str, int]:
        """Generating pairs per stage, read without any lock: enough to see that a lane has no room
        (a refusal), never to claim (a claim counts again under the lane lock)."""
        with self.db.read() as conn:
            rows = conn.execute(
                f"SELECT stage, count(*) FROM asset_states WHERE state = {literals.GENERATING}"
                " AND stage = ANY(%s) GROUP BY stage",
                (list(stages),),
            ).fetchall()
        return {stage: int(n) for stage, n in rows}

    def unclaim(self, book: str, claims: Sequence[Claim]) -> int:
        """Undo claims whose job could not be published: `generating -> pending` if the token is still ours."""
        if not claims:
            return 0
        with self.db.transaction() as conn:
            return conn.execute(
                "UPDATE asset_states a SET state = %s, dispatch_id = NULL, updated_at = now()"
                " FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[]) AS u(c, s, st, t)"
                " WHERE a.book_id = %s AND a.chapter_id = u.c AND a.scene_id = u.s AND a.stage = u.st"
                " AND a.state = %s AND a.fencing_token = u.t",
                (
                    AssetState.PENDING,
                    *pair_columns([c.pair for c in claims]),
                    [c.token for c in claims],
                    book,
                    AssetState.GENERATING,
                ),
            ).rowcount

    def mark_already_completed(self, book: str, pairs: Sequence[Pair]) -> list[Pair]:
        """`pending -> ready` for pairs whose committed artifact already has the current inputs."""
        if not pairs:
            return []
        with self.db.transaction() as conn:
            lock_book(conn, book, soon=True)  # settled under the lock every other settle holds: none misses the other's
            rows = conn.execute(
                _PAIRS_CTE + " UPDATE asset_states a SET state = %s, updated_at = now() FROM p, scenes s"
                " WHERE a.book_id = %s AND a.chapter_id = p.chapter_id AND a.scene_id = p.scene_id"
                " AND a.stage = p.stage AND a.state = %s AND a.artifact_sha256 IS NOT NULL"
                " AND s.book_id = a.book_id AND s.chapter_id = a.chapter_id AND s.scene_id = a.scene_id"
                " AND a.input_hash = s.input_hashes ->> a.stage RETURNING a.chapter_id, a.scene_id, a.stage",
                (*pair_columns(pairs), AssetState.READY, book, AssetState.PENDING),
            ).fetchall()
            settle_commands(conn, book)
        return [tuple(r) for r in rows]

    def generating_pairs(self, book: str | None = None) -> list[GeneratingRow]:
        with self.db.read() as conn:
            return [
                GeneratingRow(*r)
                for r in conn.execute(
                    "SELECT a.book_id, a.chapter_id, a.scene_id, a.stage, a.fencing_token, a.dispatch_id,"
                    " CASE WHEN j.open_dispatch = a.dispatch_id"
                    "  THEN extract(epoch FROM statement_timestamp() - j.updated_at)::float8 END"
                    " FROM asset_states a LEFT JOIN job_starts j ON j.book_id = a.book_id"
                    "  AND j.chapter_id = a.chapter_id AND j.scene_id = a.scene_id AND j.stage = a.stage"
                    " WHERE a.state = %s AND (%s::text IS NULL OR a.book_id = %s::text)",
                    (AssetState.GENERATING, book, book),
                )
            ]

    def dispatch_ids(self, pairs: Sequence[BookPair]) -> dict[BookPair, str | None]:
        """Per pair of `pairs` whose row exists, the dispatch id it carries (None: none), whatever its state."""
        if not pairs:
            return {}
        with self.db.read() as conn:
            rows = conn.execute(
                "SELECT a.book_id, a.chapter_id, a.scene_id, a.stage, a.dispatch_id FROM asset_states a"
                " JOIN unnest(%s::text[], %s::text[], %s::text[], %s::text[]) AS p(b, c, s, st)"
                " ON a.book_id = p.b AND a.chapter_id = p.c AND a.scene_id = p.s AND a.stage = p.st",
                [list(column) for column in zip(*pairs, strict=True)],
            ).fetchall()
        return {(b, c, s, st): d for b, c, s, st, d in rows}

    def expire_generating(
        self,
        book: str,
        pair: Pair,
        token: int,
        target: AssetState,
        still_lapsed: Callable[[], bool],
        *,
        stop_stands: Callable[[], bool] | None = None,
    ) -> AssetState | None:
        """A generating pair whose lease is gone goes back (`pending` or `dirty`) if its token is unchanged and
        `still_lapsed()`, asked under the pair's row lock once it is updated (a job taking its lease back reads
        the pair's row under that lock: `token_is_current(locking=True)`). `dirty` is judged again under the book's
        lock on the facts of this moment (`_facts_now`; `stop_stands` where the caller saw a cancel flag): a
        pair the gate authorizes now (its layer turned on again since the caller read it off) goes `pending`.
        *Why:* released to `dirty` with no reason to mark on its command's target, the pair waited for nothing to
        queue it, its command active for ever. Returns the state the pair went to, or None when it was left as it
        was."""
        transition(AssetState.GENERATING, target)
        chapter, scene, stage = pair
        with self.db.transaction() as conn:
            if target == AssetState.DIRTY:
                lock_book(conn, book)
                found = _facts_now(conn, book, [pair], stop_stands)
                if found is not None:
                    target = AssetState.DIRTY if decide(found[1], pair) is not None else AssetState.PENDING
            done = conn.execute(
                "UPDATE asset_states SET state = %s, dispatch_id = NULL, updated_at = now()"
                " WHERE book_id = %s AND chapter_id = %s AND scene_id = %s AND stage = %s"
                " AND state = %s AND fencing_token = %s",
                (str(target), book, chapter, scene, stage, AssetState.GENERATING, token),
            ).rowcount
            if done and not still_lapsed():
                conn.rollback()
                return None
            if done:
                journal.record(conn, "lease.expired", book, {"token": token, "to": str(target)}, pair=pair)
                if target == AssetState.DIRTY:
                    release_targets(conn, book, [pair])
        return target if done else None

    def artifact_uris(self, book: str) -> dict[Pair, str]:
        """Each pair's committed artifact's URI: the newest artifact row of the pair with its sha256."""
        with self.db.read() as conn:
            rows = conn.execute(
                "SELECT a.chapter_id, a.scene_id, a.stage, r.uri FROM asset_states a"
                " CROSS JOIN LATERAL (SELECT uri FROM artifacts r WHERE r.book_id = a.book_id"
                "  AND r.chapter_id = a.chapter_id AND r.scene_id = a.scene_id AND r.stage = a.stage"
                "  AND r.sha256 = a.artifact_sha256 AND r.uri IS NOT NULL ORDER BY r.id DESC LIMIT 1) r"
                " WHERE a.book_id = %s AND a.artifact_sha256 IS NOT NULL",
                (book,),
            ).fetchall()
        return {(chapter, scene, stage): uri for chapter, scene, stage, uri in rows}

    def pair_errors(self, book: str) -> dict[Pair, str]:
        """Why each failed pair of the book failed: its error, as its job's verdict wrote it."""
        with self.db.read() as conn:
            rows = conn.execute(
                "SELECT chapter_id, scene_id, stage, error FROM asset_states WHERE book_id = %s AND error IS NOT NULL",
                (book,),
            ).fetchall()
        return {(chapter, scene, stage): error for chapter, scene, stage, error in rows}

    def scene_states(self, book: str) -> list[tuple[str, str, str, str, str | None]]:
        """(chapter, scene, stage, state, artifact sha256) for every pair, in reading order.

        The pairs' own copy of their scene's position (kept by the database, 0006), no join to the scenes: planned
        on statistics that had not seen the book (one row estimated), that join was a nested loop that read the
        book's scenes once per pair: `status` of a book of 2,000 scenes took 0.7-1.3 s, of 50,000 eight minutes."""
        with self.db.read() as conn:
            return [
                tuple(r)
                for r in conn.execute(
                    "SELECT chapter_id, scene_id, stage, state, artifact_sha256 FROM asset_states"
                    " WHERE book_id = %s ORDER BY position, stage",
                    (book,),
                )
            ]


def _release(conn: psycopg.Connection[Any], book: str, pairs: Sequence[Pair]) -> list[Pair]:
    """`pending -> dirty` of `pairs` (compare-and-set: one no longer pending is left alone and missing from the
    answer); journalled, the targets it cuts off marked and their commands settled (`released.released_pending`)."""
    rows = conn.execute(
        _PAIRS_CTE + " UPDATE asset_states a SET state = %s, updated_at = now() FROM p"
        " WHERE a.book_id = %s AND a.chapter_id = p.chapter_id AND a.scene_id = p.scene_id"
        " AND a.stage = p.stage AND a.state = %s RETURNING a.chapter_id, a.scene_id, a.stage",
        (*pair_columns(pairs), AssetState.DIRTY, book, AssetState.PENDING),
    ).fetchall()
    moved: list[Pair] = [tuple(r) for r in rows]
    released_pending(conn, book, moved)
    return moved
