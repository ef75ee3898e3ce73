"""A GPU job's rows: the start (read under the pair's row lock), the commit, the failure and the
give-back, and the pair's open start (`job_starts`, to count starts whose worker died).

The decision whether a job may start is not made here: `starting` reads the facts under
the lock and `domain.gate.decide_job_start` and `domain.job_rules` judge them, so the rules
live in one place. Every end of a started job clears its open start in the same transaction.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from animastor_tasks.adapters.postgres import journal, literals
from animastor_tasks.adapters.postgres.gate_reads import FEW_TARGETS, HAS_FEW_TARGETS, PRIORITIES, has_target_in
from animastor_tasks.adapters.postgres.pool import LOCK_WAIT_MS, Database, answering_within, bound_lock_waits
from animastor_tasks.adapters.postgres.released import mark_released
from animastor_tasks.adapters.postgres.settle import settle_commands
from animastor_tasks.domain.book import storable
from animastor_tasks.domain.keys import book_lock, lane_lock
from animastor_tasks.domain.targets import INPUT_CHANGED
from animastor_tasks.domain.types import BookPair, Pair
from animastor_tasks.domain.vocabulary import AssetState, transition
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.ports import Committed, JobRow


class StartTransaction:
    """The open start transaction of `JobStore.starting`; `row` is None for an unknown pair."""

    def __init__(self, conn: psycopg.Connection[Any], book: str, pair: Pair, row: JobRow | None) -> None:
        self._conn, self._book, self._pair, self.row = conn, book, pair, row

    def _input_hash(self) -> str | None:
        """The scene's input hash for the stage as the start read it: what the job's media is made from."""
        return None if self.row is None else self.row.input_hash

    def record_start(self, token: int, dispatch_id: str, lost_starts: int) -> None:
        """Journal the start, keep it open until the job ends (a dead worker never ends it), and commit: both
        rows and the COMMIT go in one round trip, which also releases the row lock."""
        chapter, scene, stage = self._pair
        with self._conn.pipeline():
            self._conn.execute(
                "INSERT INTO job_starts (book_id, chapter_id, scene_id, stage, open_dispatch, lost_starts,"
                " input_hash, input_dispatch) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (book_id, chapter_id, scene_id, stage) DO UPDATE"
                " SET open_dispatch = EXCLUDED.open_dispatch, lost_starts = EXCLUDED.lost_starts,"
                " input_hash = EXCLUDED.input_hash, input_dispatch = EXCLUDED.input_dispatch, shutdown_at = NULL,"
                " updated_at = now()",
                (*(self._book, chapter, scene, stage), dispatch_id, lost_starts, self._input_hash(), dispatch_id),
            )
            detail = {"token": token, "lost_starts": lost_starts}
            journal.record(self._conn, "job.started", self._book, detail, pair=self._pair, dispatch_id=dispatch_id)
            self._conn.commit()


#: The longest a job's start check (or a paused process's ask whether Postgres answers) waits for one answer: past the
#: row lock's wait (`LOCK_WAIT_MS`), far short of `ANSWER_LIMIT_S`. *Why:* against a pooler that took the connection
#: and answered nothing, the check held its job and slot 60 s before the job was let go and the process paused.
START_ANSWER_LIMIT_S = LOCK_WAIT_MS / 1000 + 5


class JobStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def answers(self) -> bool:
        try:
            self.db.ping(within=START_ANSWER_LIMIT_S)
        except StoreUnavailable:
            return False
        return True

    @contextmanager
    def starting(self, book: str, pair: Pair) -> Iterator[StartTransaction]:
        """The pair's row, its scene input and its book's gate facts, read under the row lock.

        The lock serializes the start with a concurrent cancel: either the start commits
        first (and the job then sees the cancel through its watcher), or the cancel does
        and the facts read here show it.
        """
        chapter, scene, stage = pair
        with self.db.transaction() as conn, answering_within(conn, START_ANSWER_LIMIT_S):
            with conn.pipeline():  # BEGIN, the bounds (of its wait for the row lock, of its hold) and the read
                bound_lock_waits(conn)
                found = conn.execute(
                    "SELECT a.state, a.fencing_token, a.dispatch_id, s.text, s.prompt,"
                    " EXISTS (SELECT 1 FROM cancel_tombstones t WHERE t.book_id = a.book_id),"
                    " EXISTS (SELECT 1 FROM commands c JOIN command_targets ct ON ct.command_id = c.command_id"
                    f"  WHERE c.book_id = a.book_id AND c.status = {literals.ACTIVE}"
                    "  AND ct.chapter_id = a.chapter_id"
                    "  AND ct.scene_id = a.scene_id AND ct.stage = a.stage),"
                    " b.layer_config, j.open_dispatch, coalesce(j.lost_starts, 0), s.input_hashes ->> a.stage,"
                    " j.shutdown_at IS NOT NULL"
                    " FROM asset_states a JOIN scenes s ON s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
                    "  AND s.scene_id = a.scene_id JOIN books b ON b.book_id = a.book_id"
                    " LEFT JOIN job_starts j ON j.book_id = a.book_id AND j.chapter_id = a.chapter_id"
                    "  AND j.scene_id = a.scene_id AND j.stage = a.stage"
                    " WHERE a.book_id = %s AND a.chapter_id = %s AND a.scene_id = %s AND a.stage = %s FOR UPDATE OF a",
                    (book, chapter, scene, stage),
                ).fetchone()
            yield StartTransaction(conn, book, pair, None if found is None else JobRow(*found))

    def commit_job(
        self, book: str, pair: Pair, token: int, dispatch_id: str, artifact: dict[str, Any], lane: str
    ) -> Committed | None:
        """`generating -> ready` (`dirty`: below) + the artifact row, only if the token is still current (None:
        stale); in too when this dispatch's commit is already in (a commit sent again). With it, what the book has
        left pending of the stage (`Committed`), which weighs the book for the slot its job freed (`free_slot`).

        The pair keeps the hash of the input its media was made from (`artifact["input_hash"]`, read at the
        job's start), not the scene's hash now. Absent: the current one. When the two differ (the scene was
        re-imported while the job ran) the pair goes `dirty` and its targets are released `input_changed`, as the
        import does to a `ready` pair it finds stale: landed `ready`, it passed for made from the new input, its
        command counted it done, and the next import, an identical one, released it then.
        """
        owned = _owned(book, pair, token, dispatch_id)
        with self.db.transaction() as conn:
            # Pipeline mode: BEGIN, the locks, the update with its artifact row, the journal, the start's end
            # and the settle read reach the server in one round trip, then COMMIT: two round trips under the
            # book's and the lane's locks, which every claim of the lane waits for (three before, nine before
            # that). A stale token matches no row: the transaction is rolled back and nothing of it stays.
            # The row inserted returns what the book has left pending of the stage (no statement of its own):
            # read before the update is seen, its pair counts as generating, and a command its commit settles
            # has no target pending either.
            with conn.pipeline():
                _lock_capacity(conn, lane, book)
                committed = conn.execute(
                    "WITH done AS (UPDATE asset_states a SET state = CASE WHEN coalesce(%(input_hash)s::text,"
                    " s.input_hashes ->> a.stage) IS NOT DISTINCT FROM s.input_hashes ->> a.stage THEN %(ready)s"
                    " ELSE %(dirty)s END, artifact_sha256 = %(sha256)s,"
                    " input_hash = coalesce(%(input_hash)s, s.input_hashes ->> a.stage), error = NULL,"
                    " updated_at = now() FROM scenes s"
                    f" WHERE {_OWNED} AND s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
                    " AND s.scene_id = a.scene_id RETURNING a.state)"
                    " INSERT INTO artifacts (sha256, size_bytes, media_type, book_id, chapter_id, scene_id, stage,"
                    " fencing_token, dispatch_id, generator, duration_ms, path, uri)"
                    " SELECT %(sha256)s, %(size)s, %(media_type)s, %(book)s, %(chapter)s, %(scene)s, %(stage)s,"
                    f" %(token)s, %(dispatch_id)s, %(generator)s, %(duration_ms)s, %(path)s, %(uri)s FROM done"
                    f" RETURNING {_PENDING_RANK}, (SELECT state FROM done)",
                    {**owned, **_RANKS, **_LANDS, "uri": None, "input_hash": None, **artifact},
                )
                detail = {"token": token, "sha256": artifact["sha256"]}
                journal.record(conn, "job.ready", book, detail, pair=pair, dispatch_id=dispatch_id)
                _end_start(conn, book, pair, None)
                settle_commands(conn, book, pair)
            row = committed.fetchone()
            if row is not None and row[1] == AssetState.DIRTY:  # made from the text an import replaced meanwhile
                # Journalled as what it is (the pipeline wrote `job.ready` before the state was known): counted ready,
                # a scene that is not read as ready to whoever reads the journal.
                conn.execute(  # this transaction's own row: `at` is its start (the index), the dispatch its own
                    "UPDATE events SET kind = 'job.outdated' WHERE at = now() AND kind = 'job.ready'"
                    " AND dispatch_id = %s",
                    (dispatch_id,),
                )
                mark_released(conn, book, {INPUT_CHANGED: [pair]})
            if row is None:
                conn.rollback()
                # This very commit may have landed already, its answer lost with its connection (a retry after a
                # failover, `flow.job.when_reachable`): the dispatch's artifact row says so (not whether it
                # landed `dirty`: that answer is gone with the connection).
                row = conn.execute(
                    f"SELECT {_PENDING_RANK}, NULL FROM artifacts WHERE dispatch_id = %(dispatch_id)s",
                    {**owned, **_RANKS},
                ).fetchone()
        return None if row is None else Committed(row[0], outdated=row[1] == AssetState.DIRTY)

    def fail_job(self, book: str, pair: Pair, token: int, dispatch_id: str, error: str, lane: str) -> Committed | None:
        """`generating -> failed` with the error, only if the token is still current (None: stale); with it what the
        book has left pending of the stage, as `commit_job` answers (`_left`)."""
        owned = _owned(book, pair, token, dispatch_id)
        with self.db.transaction() as conn:
            with conn.pipeline():  # BEGIN, the bounds and the locks in one round trip
                _lock_capacity(conn, lane, book)
            done = conn.execute(
                f"UPDATE asset_states a SET state = %(failed)s, error = %(error)s, updated_at = now() WHERE {_OWNED}",
                {**owned, "failed": AssetState.FAILED, "error": _storable(error, 4000)},
            ).rowcount
            if not done:  # fenced off: the job ended all the same, and its start with it (not a worker lost)
                _end_start(conn, book, pair, dispatch_id)
                return None
            with conn.pipeline():  # the journal, the start's end, the settle and the read of what is left
                detail = {"error": _storable(error, 1000)}
                journal.record(conn, "job.failed", book, detail, pair=pair, dispatch_id=dispatch_id)
                _end_start(conn, book, pair, None)
                settle_commands(conn, book, pair)
                return _left(conn, owned)

    def give_back(
        self,
        book: str,
        pair: Pair,
        token: int,
        dispatch_id: str,
        reason: str,
        lane: str,
        *,
        released: bool = False,
        ran: bool = True,
    ) -> Committed | None:
        """`generating -> pending`, only if the token is still current (None: stale): the run ended without a verdict
        on the scene (a store blip, the backend down); the next gate pass decides again. With it what the book has
        left pending of the stage, its pair given back among it (`_left`). `released`: to `dirty` instead, its
        targets released for `reason` (a job refused at its start because its layer is off: given back `pending`,
        its book's pass released it only if the layer was still off by then, and turned on again within the tick,
        the layer ran the job with no new regenerate). `ran`: False for a job refused at its start check
        (`_end_start`)."""
        state = transition(AssetState.GENERATING, AssetState.DIRTY if released else AssetState.PENDING)
        owned = _owned(book, pair, token, dispatch_id)
        with self.db.transaction() as conn:
            with conn.pipeline():  # BEGIN, the bounds and the locks in one round trip
                _lock_capacity(conn, lane, book)
            done = conn.execute(
                f"UPDATE asset_states a SET state = %(state)s, dispatch_id = NULL, updated_at = now() WHERE {_OWNED}",
                {**owned, "state": state},
            ).rowcount
            if done and released:
                mark_released(conn, book, {reason: [pair]})
            with conn.pipeline():
                if done:
                    detail = {"token": token, "reason": _storable(reason, 1000)}
                    journal.record(conn, "job.given_back", book, detail, pair=pair, dispatch_id=dispatch_id)
                _end_start(conn, book, pair, dispatch_id, ran=ran)
                return _left(conn, owned) if done else None

    def end_start(self, book: str, pair: Pair, dispatch_id: str) -> None:
        """A started job ended without a commit (stopped, fenced off at commit): its start is closed."""
        with self.db.transaction() as conn:
            _end_start(conn, book, pair, dispatch_id)

    def token_is_current(self, book: str, pair: Pair, token: int, dispatch_id: str, *, locking: bool = False) -> bool:
        """`locking`: read under the row's lock (FOR SHARE), so a takeover that is changing the row is waited for."""
        lock = " FOR SHARE" if locking else ""
        with self.db.read() as conn:
            row = conn.execute(
                f"SELECT 1 FROM asset_states a WHERE {_OWNED}{lock}", _owned(book, pair, token, dispatch_id)
            ).fetchone()
        return row is not None


# The rank of the book's most urgent pending pair of the stage that an authorizing command targets (NULL: none): the
# pairs a refill's candidates are (`GateReads.gate_candidates`), so the two agree. Each command's search stops at the
# first pending target it finds (`has_target_in`), its head the first pending pairs of the stage in reading order (the
# pending-only index of 0006; a whole-book command's are its own). Walking the book's pending pairs alone, a chapter's
# command whose last scenes ran read every pending pair of a whole-book command beside it, at each commit, under the
# lane's lock.
_PENDING_RANK = (
    "(WITH head AS MATERIALIZED (SELECT stage, chapter_id, scene_id FROM asset_states WHERE book_id = %(book)s"
    f"  AND stage = %(stage)s AND state = {literals.PENDING} ORDER BY position LIMIT {FEW_TARGETS})"
    " SELECT min(array_position(%(priorities)s::text[], c.priority)) - 1 FROM"
    f" (SELECT c.command_id, c.stage, c.priority, {HAS_FEW_TARGETS} AS few FROM commands c WHERE c.book_id = %(book)s"
    f"  AND c.stage = %(stage)s AND c.status IN {literals.AUTHORIZING_STATUSES}) c"
    f" WHERE {has_target_in(f'({literals.PENDING})')})"
)
_RANKS = {"priorities": PRIORITIES}
_LANDS = {"ready": AssetState.READY, "dirty": AssetState.DIRTY}  # a commit's pair: ready, or dirty if made stale


def _left(conn: psycopg.Connection[Any], owned: dict[str, Any]) -> Committed:
    """What a failure or a give-back left the book pending of the stage (`_PENDING_RANK`), read after its write: a
    pair it sent back to `pending` counts. *Why:* weighed at the ended job's priority instead, a capped book's reader's
    scene waited behind normal books after its bulk job failed, and a reader whose last job failed waited again at
    the interactive rank with nothing pending."""
    row = conn.execute(f"SELECT {_PENDING_RANK}", {**owned, **_RANKS}).fetchone()
    return Committed(None if row is None else row[0])


# The pair is still this job's: generating under its token and dispatch id.
_OWNED = (
    "a.book_id = %(book)s AND a.chapter_id = %(chapter)s AND a.scene_id = %(scene)s AND a.stage = %(stage)s"
    f" AND a.state = {literals.GENERATING}"
    " AND a.fencing_token = %(token)s AND a.dispatch_id = %(dispatch_id)s"
)


def _owned(book: str, pair: Pair, token: int, dispatch_id: str) -> dict[str, Any]:
    chapter, scene, stage = pair
    return {
        "book": book,
        "chapter": chapter,
        "scene": scene,
        "stage": stage,
        "token": token,
        "dispatch_id": dispatch_id,
    }


def note_shutdown(url: str, starts: Sequence[tuple[BookPair, str]], timeout: float = 2.0) -> int:
    """The open starts of these (pair, dispatch id) were told to stop by a shutdown of their worker (0011); how many.
    One connection of its own, bounded by `timeout`, no pool: this runs in the worker's signal handler, where a pool's
    threads must not start."""
    if not starts:
        return 0
    columns = [list(c) for c in zip(*((*pair, dispatch_id) for pair, dispatch_id in starts), strict=True)]
    try:
        with psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=max(1, round(timeout)),
            options=f"-c statement_timeout={int(timeout * 1000)}",
        ) as conn:
            return conn.execute(
                "UPDATE job_starts j SET shutdown_at = now()"
                " FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[]) AS s(b, c, sc, st, d)"
                " WHERE j.book_id = s.b AND j.chapter_id = s.c AND j.scene_id = s.sc AND j.stage = s.st"
                " AND j.open_dispatch = s.d",
                columns,
            ).rowcount
    except psycopg.Error as err:
        raise StoreUnavailable("postgres", url, str(err).strip() or type(err).__name__) from err


def _end_start(
    conn: psycopg.Connection[Any], book: str, pair: Pair, dispatch_id: str | None, *, ran: bool = True
) -> None:
    """A started job ended: its start is no longer open and the run of worker-lost starts is over.
    With a dispatch id only that job's own open start is cleared. A newer start stays open and, where this job `ran`
    (its start was recorded: not one refused at its start check), gives back the lost start it counted for it: the
    job lived (cut off from Redis past its lease, taken over, back), its scene killed nothing. *Why:* three
    partitions of a host running one long scene failed it `worker_lost: 3 starts`. Each column is judged on the row
    the UPDATE writes (a subquery's read went stale behind a concurrent start, whose open start it then cleared), and
    the newer start keeps its time: it is that start's age (`Assets.generating_pairs`)."""
    chapter, scene, stage = pair
    mine = "(%(dispatch)s::text IS NULL OR open_dispatch = %(dispatch)s::text)"
    given_back = "greatest(lost_starts - 1, 0)" if ran else "lost_starts"
    conn.execute(
        f"UPDATE job_starts SET open_dispatch = CASE WHEN {mine} THEN NULL ELSE open_dispatch END,"
        f" lost_starts = CASE WHEN {mine} THEN 0 ELSE {given_back} END,"
        f" updated_at = CASE WHEN {mine} THEN now() ELSE updated_at END"
        " WHERE book_id = %(book)s AND chapter_id = %(chapter)s AND scene_id = %(scene)s AND stage = %(stage)s",
        {"dispatch": dispatch_id, "book": book, "chapter": chapter, "scene": scene, "stage": stage},
    )


def _lock_capacity(conn: psycopg.Connection[Any], lane: str, book: str) -> None:
    """A completion frees capacity under the locks a claim counts it under, in its order (`keys.claim_locks`: the
    book, then the lane), so a commit waiting for its book holds no lane; its waits bounded (`bound_lock_waits`)."""
    bound_lock_waits(conn)
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (book_lock(book),))
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (lane_lock(lane),))


def _storable(text: str, limit: int) -> str:
    """An error's words as Postgres keeps them: a NUL or a lone surrogate (a binary error page, a plugin's message)
    made the verdict's write itself fail, and the pair ran again until it failed as a lost worker."""
    return storable(text[:limit])
