"""The gate's reads of asset states: every in-flight pair of some books (one statement), of one book page by
page (a server-side cursor), or only a book's next candidates for a refill; and which scenes have work.

Read-only: the moves and the claim are `assets.py`'s.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Any

import psycopg

from animastor_tasks.adapters.postgres import literals
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.domain.types import Pair, SceneKey
from animastor_tasks.domain.vocabulary import IN_FLIGHT, Priority, priority_rank, values
from animastor_tasks.ports import GateRows
from animastor_tasks.records import InFlight

# A book's own row among its gate rows (no chapter): its layers (8th column) and its tombstone (12th).
_BOOK_COLUMNS = (
    " SELECT b.book_id, NULL, NULL, NULL, NULL, 0, -1, b.layer_config, NULL, NULL, false,"
    "  EXISTS (SELECT 1 FROM cancel_tombstones t WHERE t.book_id = b.book_id), -1, NULL"
    " FROM books b WHERE b.book_id"
)
_BOOK_ROW = _BOOK_COLUMNS + " = ANY(%(books)s)"
# One book's row, for a statement that reads one book: an array of unknown length made its generic
# plan look dearer than planning afresh, so the server planned it on every run.
_ONE_BOOK_ROW = _BOOK_COLUMNS + " = %(book)s"


# A command of at most this many targets has them looked up by key (a refill's candidates, a settle's search
# for one in flight); a bigger one is found through the book's pending or in-flight pairs, which an index holds
# (a settle looks at this many of them, then walks the command's own targets: `settle.py`).
FEW_TARGETS = 100
# A command's targets in key order: a walk of the primary key, whatever the statistics say. Taken just after a
# whole-book command, they know one command holding every target, so any other command's were estimated at the
# whole table and looked for by a scan of it (41 ms per refill at 50,000 targets beside eight one-scene commands).
TARGETS_BY_KEY = "ORDER BY {0}.chapter_id, {0}.scene_id"
# The targets of the command aliased {0} when it has few (its `few`), none otherwise.
FEW_TARGETS_OF = (
    "SELECT * FROM command_targets t WHERE {0}.few AND t.command_id = {0}.command_id"
    f" {TARGETS_BY_KEY.format('t')} LIMIT {FEW_TARGETS}"
)
# Whether the command `c` has few targets: its count, kept on its row (migration 0007; unknown counts as many).
HAS_FEW_TARGETS = f"coalesce(c.target_count, {FEW_TARGETS + 1}) <= {FEW_TARGETS}"


def has_target_in(states: str, *, unreleased: bool = False) -> str:
    """Whether the command aliased `c` (its `command_id`, `stage` and `few`) has a target whose pair is in `states`
    (a settle's search for one in flight, a commit's for one pending), `unreleased` ones only if asked. The search
    stops at the first, so it costs what the command holds, never what the book has in those states. A command of
    many targets looks first among `head` (the first FEW_TARGETS pairs of each stage in `states`, a CTE the caller
    reads once: its `stage`, `chapter_id`, `scene_id`); fewer than FEW_TARGETS are every such pair of the stage, and
    the answer is there. Only past them does it, as one of few does at once, walk its own targets by key, ordered in
    a subquery of its own so that the walk is planned to stop early (planned for all of them, it sorted them
    first). *Why:* searching the book's pairs alone, a chapter's command read them all when its own lay last (53-66
    ms a commit under the lane's lock at 50,000 pending pairs); walking the targets whenever none of the head was
    its own, a whole-book command's last commits read every target (50,000 rows, 150 ms)."""
    released = " AND o.released IS NULL" if unreleased else ""
    return (
        "CASE WHEN NOT c.few AND EXISTS (SELECT 1 FROM head f CROSS JOIN LATERAL (SELECT 1 FROM command_targets o"
        f"  WHERE o.command_id = c.command_id AND o.chapter_id = f.chapter_id AND o.scene_id = f.scene_id{released}"
        "  OFFSET 0) o WHERE f.stage = c.stage) THEN true"
        f" WHEN NOT c.few AND (SELECT count(*) FROM head f WHERE f.stage = c.stage) < {FEW_TARGETS} THEN false"
        f" ELSE EXISTS (SELECT 1 FROM (SELECT 1 FROM command_targets o {pair_row_of('o', 'state')} f"
        f"  WHERE o.command_id = c.command_id{released} AND f.state IN {states} {TARGETS_BY_KEY.format('o')}) o) END"
    )


# The gate rows of books: each book's own row (`_BOOK_ROW`), then its in-flight pairs, a row each, unordered (a
# sort of a big book's rows spills to disk; the pass orders the few it claims). Whether an active command targets a
# pair, and its place, come from the books' active commands, not from every target the pair ever had: looked up on
# the pair, kept history (a whole-book command keeps a target per scene) was read and dropped on every pass (34 ms
# a pass of 2,000 pairs at 6 targets a pair, 65 ms at 31; 11 ms now). A command of many targets (whole-book,
# chapters: a handful) is looked up by key for each pair of its stage; those of few (a reader's scenes, which may
# be many) name their targets once, in a hashed set, and a pair in it, or of a stage of more than `_PROBED`
# commands of many targets, is looked up on the pair as before. Lookups by key leave no plan that reads a group
# once per pair, as a join to the book's commanded targets grouped first did on statistics that saw the book idle
# (5.7 s per pass of a book of 5,000 pending pairs).
# `of_books` (which books) restricts the joined scenes and the commands too: the server does not carry a list of
# books across a join, and a hash join of one small book's pairs hashed every scene and target of the farm
# (33 ms per book of 1,000 pairs beside 99 others, 8 ms with the restriction).
# A command's place: its priority's rank, then when it was made (a refill's order); a pair's: its commands' least.
_PLACE = "ARRAY[array_position(%(priorities)s::text[], c.priority)::float8, extract(epoch FROM c.created_at)::float8]"
# More commands of many targets than this on a book's stage, and its pairs are looked up on the pair: a probe per
# command and pair would cost more than the pair's own targets.
_PROBED = 4
# The place of the pair `a` (NULL: no active command targets it), from the books' active commands (`active`, `many`).
_PLACE_OF_PAIR = (
    "CASE WHEN (a.book_id, a.chapter_id, a.scene_id, a.stage) IN (SELECT c.book_id, t.chapter_id, t.scene_id,"
    f"  c.stage FROM active c CROSS JOIN LATERAL ({FEW_TARGETS_OF.format('c')}) t) OR (a.book_id, a.stage) IN"
    f"  (SELECT book_id, stage FROM many GROUP BY 1, 2 HAVING count(*) > {_PROBED})"
    f" THEN (SELECT min({_PLACE}) FROM command_targets t JOIN commands c ON c.command_id = t.command_id"
    f"  AND c.status IN {literals.AUTHORIZING_STATUSES} WHERE t.book_id = a.book_id AND t.chapter_id = a.chapter_id"
    "  AND t.scene_id = a.scene_id AND t.stage = a.stage)"
    " ELSE (SELECT min(c.place) FROM many c WHERE c.book_id = a.book_id AND c.stage = a.stage"
    "  AND EXISTS (SELECT 1 FROM command_targets t WHERE t.command_id = c.command_id"
    "   AND t.chapter_id = a.chapter_id AND t.scene_id = a.scene_id)) END"
)


def _gate_rows_sql(of_books: str, pairs: str, book_row: str) -> str:
    return (
        f"WITH active AS MATERIALIZED (SELECT c.command_id, c.book_id, c.stage, {HAS_FEW_TARGETS} AS few,"
        f"  {_PLACE} AS place FROM commands c WHERE c.book_id {of_books}"
        f"  AND c.status IN {literals.AUTHORIZING_STATUSES}),"
        " many AS MATERIALIZED (SELECT * FROM active WHERE NOT few),"
        " flight AS (SELECT book_id, chapter_id, scene_id, stage, state, fencing_token, position, dispatch_id,"
        "  input_hash, current_hash, has_artifact, place IS NOT NULL AS commanded,"
        "  coalesce(place[1]::int - 1, %(normal)s) AS rank, place[2] AS since"
        "  FROM (SELECT a.book_id, a.chapter_id, a.scene_id, a.stage, a.state, a.fencing_token, s.position,"
        "   a.dispatch_id, a.input_hash, s.input_hashes ->> a.stage AS current_hash,"
        f"   a.artifact_sha256 IS NOT NULL AS has_artifact, {_PLACE_OF_PAIR} AS place"
        "   FROM asset_states a JOIN scenes s ON s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
        f"    AND s.scene_id = a.scene_id AND s.book_id {of_books}"
        f"   WHERE a.book_id {of_books} AND {pairs} AND a.state IN {literals.IN_FLIGHT_STATES}"
        # A subquery of its own (OFFSET 0): pulled up, the place was worked out once per column reading it.
        "   OFFSET 0) f)" + book_row + " UNION ALL SELECT * FROM flight"
    )


_GATE_ROWS = _gate_rows_sql("= ANY(%(books)s)", "true", _BOOK_ROW)
# The same of one book (a pass of its own): the list of books left the server planning
# the statement afresh on every run (0.6 ms of a regenerate's pass of a book with one pair in flight).
_GATE_ROWS_OF_BOOK = _gate_rows_sql("= %(book)s", "true", _ONE_BOOK_ROW)
# The same of a few pairs of one book, each looked up by its key (a takeover judges its dead jobs' pairs).
_GATE_ROWS_OF_PAIRS = _gate_rows_sql(
    "= %(book)s",
    "(a.chapter_id, a.scene_id, a.stage) IN"
    " (SELECT * FROM unnest(%(chapters)s::text[], %(scenes)s::text[], %(stages)s::text[]))",
    _ONE_BOOK_ROW,
)


def pair_row_of(target: str, columns: str = "*") -> str:
    """The asset row of the target aliased `target`, looked up by its key alone: a lateral the planner can
    neither turn into a walk of the book's pending pairs nor answer from a state's partial index, as
    statistics that saw the book idle made it do. The caller filters the state."""
    return (
        f"CROSS JOIN LATERAL (SELECT {columns} FROM asset_states WHERE book_id = {target}.book_id"
        f" AND chapter_id = {target}.chapter_id AND scene_id = {target}.scene_id AND stage = {target}.stage"
        " OFFSET 0)"
    )


# The priorities in rank order, for `array_position` (an array parameter: the order is the point).
PRIORITIES = [str(p) for p in Priority]


def pair_columns(pairs: Sequence[Pair]) -> tuple[list[str], list[str], list[str]]:
    """Pairs as three arrays (chapters, scenes, stages), for `unnest`."""
    return [p[0] for p in pairs], [p[1] for p in pairs], [p[2] for p in pairs]


def rows_of_pairs(conn: psycopg.Connection[Any], book: str, pairs: Sequence[Pair]) -> GateRows | None:
    """`GateReads.gate_rows` of these pairs, on `conn` (a transaction's: under the book's lock, say)."""
    columns = dict(zip(("chapters", "scenes", "stages"), pair_columns(pairs), strict=True))
    rows = conn.execute(_GATE_ROWS_OF_PAIRS, {**_gate_row_params([book]), **columns}).fetchall()
    return _gate_rows_by_book([book], rows)[book]


def _gate_row_params(books: Sequence[str]) -> dict[str, Any]:
    return {
        "books": list(books),
        "book": books[0] if len(books) == 1 else None,  # `_GATE_ROWS_OF_BOOK`'s
        "priorities": PRIORITIES,
        "normal": priority_rank(Priority.NORMAL),
    }


# A gate row's pair is `_new(InFlight, (*row[1:], row[1:4]))`: the columns after the book id, then the pair
# they name. Written inline where rows are walked: a call of `InFlight._make` per row was a tenth of a pass.
_new = tuple.__new__


def _gate_rows_by_book(books: Sequence[str], rows: Sequence[Any]) -> dict[str, GateRows | None]:
    heads: dict[str, Any] = {}
    pairs: dict[str, list[InFlight]] = {book: [] for book in books}
    for row in rows:  # one walk: a book of 10k pairs makes 10k rows
        if row[1] is None:  # a book's own row (`_BOOK_ROW`): no chapter
            heads[row[0]] = row
        else:
            pairs[row[0]].append(_new(InFlight, (*row[1:], row[1:4])))
    found: dict[str, GateRows | None] = dict.fromkeys(books)
    for book, head in heads.items():  # the pairs of a book whose own row is gone are dropped: unknown book
        in_flight = tuple(pairs[book])
        commanded = frozenset([i.pair for i in in_flight if i.commanded])
        found[book] = GateRows(head[7], bool(head[11]), commanded, in_flight)
    return found


class GateReads:
    def __init__(self, db: Database) -> None:
        self.db = db

    def gate_rows(self, book: str, pairs: Sequence[Pair] | None = None) -> GateRows | None:
        """Everything a gate pass needs from Postgres, in one statement; None for an unknown book.
        `pairs`: of those in-flight pairs only, read by key, whatever the size of the book."""
        if pairs is None:
            found = self.gate_rows_many([book])
            assert found is not None  # no limit asked
            return found[book]
        with self.db.read() as conn:
            return rows_of_pairs(conn, book, pairs)

    def gate_rows_many(self, books: Sequence[str], limit: int | None = None) -> dict[str, GateRows | None] | None:
        """`gate_rows` of several books in one statement (a tick's batch); None for an unknown book.
        With `limit`: None when the books have more in-flight pairs than that (read them page by page).

        Only in-flight pairs are read, each flagged with whether an active command targets it:
        idle pairs and the targets of finished work cost nothing.
        """
        whole = _GATE_ROWS_OF_BOOK if len(books) == 1 else _GATE_ROWS
        # The limited read is planned as the whole read (a CTE is planned for all its rows): a LIMIT on the
        # statement itself made the planner pick a fast-start plan, 40% slower for 10k pairs.
        limited = "WITH g AS MATERIALIZED (" + whole + ") SELECT * FROM g LIMIT %(limit)s"
        with self.db.read() as conn:
            rows = conn.execute(
                whole if limit is None else limited,
                {**_gate_row_params(books), "limit": None if limit is None else limit + len(books) + 1},
            ).fetchall()
        if limit is not None and len(rows) > limit + len(books):
            return None
        return _gate_rows_by_book(books, rows)

    def gate_row_pages(self, book: str, size: int) -> Generator[GateRows, None, None]:
        """`gate_rows` of one book, `size` pairs at a time (a server-side cursor of the same statement):
        a pass over a book of a million pairs holds one page. Nothing for an unknown book.

        The cursor is held past its transaction (WITH HOLD, made in autocommit): its rows are worked out at once
        and no lock is kept while the pass reads them. *Why:* its transaction held asset_states for the whole pass;
        a table lock asked for meanwhile (an ALTER TABLE, a VACUUM FULL) queued the pass's own next statement (the
        lane count, a claim) behind it, a wait through the client that Postgres sees as no deadlock: the pass, and
        every reader of the table, hung until the lock's asker gave up."""
        with self.db.read() as conn, conn.cursor(name="gate_rows", withhold=True) as cursor:
            cursor.itersize = size
            # The list's statement: a cursor is planned once, and the one-book statement's plan for a cursor
            # (fast start) read a book of 100,000 pairs a third slower.
            cursor.execute(_GATE_ROWS, _gate_row_params([book]))
            head: Any = None
            while batch := cursor.fetchmany(size):
                heads = [row for row in batch if row[1] is None]
                head = heads[0] if heads else head
                pairs = tuple([_new(InFlight, (*row[1:], row[1:4])) for row in batch if row[1] is not None])
                if head is None:
                    head = conn.execute(_BOOK_ROW, {"books": [book]}).fetchone()
                    if head is None:
                        return
                yield GateRows(head[7], bool(head[11]), frozenset([i.pair for i in pairs if i.commanded]), pairs)

    def in_flight_scene_pages(self, books: Sequence[str], size: int) -> Iterator[dict[str, list[SceneKey]]]:
        """The books' scenes with a pair in flight, by book, `size` scenes at a time (one server-side cursor for
        them all): a book of a million pairs is never held at once, and a farm of thousands of small books costs
        a statement per page, not one per book."""
        with self.db.transaction() as conn, conn.cursor(name="in_flight_scenes") as cursor:
            cursor.itersize = size
            cursor.execute(
                "SELECT DISTINCT book_id, chapter_id, scene_id FROM asset_states"
                f" WHERE book_id = ANY(%s) AND state IN {literals.IN_FLIGHT_STATES}",
                (list(books),),
            )
            while batch := cursor.fetchmany(size):
                page: dict[str, list[SceneKey]] = {}
                for book, chapter, scene in batch:
                    page.setdefault(book, []).append((chapter, scene))
                yield page

    def in_flight_scene_count(self, book: str) -> int:
        """How many scenes of the book have a pair in flight."""
        with self.db.read() as conn:
            row = conn.execute(
                "SELECT count(DISTINCT (chapter_id, scene_id)) FROM asset_states"
                " WHERE book_id = %s AND state = ANY(%s)",
                (book, values(IN_FLIGHT)),
            ).fetchone()
        return int(row[0]) if row else 0

    def scenes_in_flight(self, book: str, scenes: Sequence[SceneKey]) -> set[SceneKey]:
        """Which of `scenes` have a pair in flight."""
        with self.db.read() as conn:
            found = conn.execute(
                "SELECT DISTINCT a.chapter_id, a.scene_id FROM asset_states a"
                " JOIN unnest(%s::text[], %s::text[]) AS u(c, s) ON a.chapter_id = u.c AND a.scene_id = u.s"
                " WHERE a.book_id = %s AND a.state = ANY(%s)",
                ([c for c, _ in scenes], [sc for _, sc in scenes], book, values(IN_FLIGHT)),
            ).fetchall()
        return {(c, sc) for c, sc in found}

    def gate_candidates(self, book: str, stages: Sequence[str], limit: int) -> GateRows | None:
        """The book's first `limit` pending pairs of `stages` that an active command targets, in the order
        they should get slots, with the facts that decide them: what a refill needs, at a cost that
        follows `limit` and the number of active commands, not the size of the book. None: unknown book.

        Each active command (most urgent priority first, oldest first) gives its first `limit` pending targets
        in reading order; a pair two commands target comes once, at the first. A command of many targets walks
        the book's pending pairs in reading order and stops at the limit (done pairs are never read); one of
        few targets reads those (walking the book for them read all of its pending pairs when they ran).
        """
        columns = (
            "a.book_id, a.chapter_id, a.scene_id, a.stage, a.state, a.fencing_token, a.position, a.dispatch_id,"
            " a.input_hash, s.input_hashes ->> a.stage, a.artifact_sha256 IS NOT NULL, true, cmd.rank, cmd.since"
        )
        # Each pair's scene by its key: as a join, statistics that had not seen the book made the plan rescan
        # the book's scenes for every candidate (86 ms at 50,000 pending pairs).
        scene = (
            "CROSS JOIN LATERAL (SELECT input_hashes FROM scenes WHERE book_id = a.book_id"
            " AND chapter_id = a.chapter_id AND scene_id = a.scene_id OFFSET 0) s"
        )
        with self.db.read() as conn:
            rows = conn.execute(
                "WITH cmd AS (SELECT command_id, stage,"
                "  array_position(%(priorities)s::text[], priority) - 1 AS rank,"
                f"  extract(epoch FROM created_at)::float8 AS since, {HAS_FEW_TARGETS} AS few FROM commands c"
                f"  WHERE book_id = %(book)s AND status IN {literals.AUTHORIZING_STATUSES}"
                "  AND stage = ANY(%(stages)s)),"
                " flight AS (SELECT DISTINCT ON (x.chapter_id, x.scene_id, x.stage) x.* FROM cmd CROSS JOIN LATERAL"
                # Many targets: the pending pairs of the stage in reading order (the pending-only index of 0006).
                f"  ((SELECT {columns} FROM asset_states a {scene}"
                "   WHERE NOT cmd.few AND a.book_id = %(book)s AND a.stage = cmd.stage"
                f"   AND a.state = {literals.PENDING} AND EXISTS (SELECT 1 FROM command_targets t"
                "    WHERE t.command_id = cmd.command_id AND t.chapter_id = a.chapter_id AND t.scene_id = a.scene_id"
                "    OFFSET 0)"
                f"   ORDER BY a.position LIMIT {int(limit)})"
                # Few targets: each of them looked up by its key (`pair_row_of`), then kept if pending.
                f"  UNION ALL (SELECT {columns} FROM ({FEW_TARGETS_OF.format('cmd')}) t {pair_row_of('t')} a"
                f"   {scene} WHERE a.state = {literals.PENDING}"
                f"   ORDER BY a.position LIMIT {int(limit)})) x"
                "  ORDER BY x.chapter_id, x.scene_id, x.stage, x.rank, x.since)"
                + _ONE_BOOK_ROW
                + f" UNION ALL (SELECT * FROM flight ORDER BY 13, 14, 7 LIMIT {int(limit)})"
                " ORDER BY 1, 13, 14 NULLS LAST, 7",
                {
                    "book": book,
                    "stages": list(stages),
                    "priorities": PRIORITIES,
                },
            ).fetchall()
        return _gate_rows_by_book([book], rows)[book]
