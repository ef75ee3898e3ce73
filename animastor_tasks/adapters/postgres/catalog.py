"""Books, chapters, scenes and layer config in Postgres."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import psycopg
from psycopg.types.json import Jsonb

from animastor_tasks.adapters.postgres import journal
from animastor_tasks.adapters.postgres.locks import lock_book
from animastor_tasks.adapters.postgres.pool import ANALYZE_FROM_ROWS, Database
from animastor_tasks.adapters.postgres.released import mark_released, release_stages
from animastor_tasks.domain.book import Book
from animastor_tasks.domain.gate import changed_layers
from animastor_tasks.domain.inputs import scene_hashes
from animastor_tasks.domain.registry import MediaRegistry
from animastor_tasks.domain.resend import FirstSending, named_match, spelled_out
from animastor_tasks.domain.targets import INPUT_CHANGED, SCENE_REMOVED
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import AssetState, Priority
from animastor_tasks.ports import CommandContext


@dataclass(frozen=True)
class ImportSummary:
    book_id: str
    created: bool
    scenes_added: int
    scenes_changed: int
    scenes_removed: int
    assets_dirtied: int
    # The removed scenes' pairs that were dispatched, with their dispatch ids: jobs to stop (not part of the output).
    removed_jobs: tuple[tuple[Pair, str], ...] = field(default=(), repr=False)

    def public(self) -> dict[str, object]:
        """What `book import` answers."""
        return {k: v for k, v in self.__dict__.items() if k != "removed_jobs"}


_COMMAND_CONTEXT = (
    "SELECT b.layer_config,"
    " ARRAY(SELECT c.command_id::text FROM commands c WHERE c.request_id = %(request)s),"
    " ARRAY(SELECT ARRAY[s.chapter_id, s.scene_id] {scenes} ORDER BY s.position)"
    " FROM books b WHERE b.book_id = %(book)s"
)
_EVERY_SCENE = "FROM scenes s WHERE s.book_id = b.book_id"
# The named scenes looked up one by one by key (each once): as a filter or a join, any plan could read every
# scene of the book, and did (19 ms for one scene of a book of 100,000); a lateral lookup cannot.
_NAMED_SCENES = (
    "FROM (SELECT DISTINCT c, sc FROM unnest(%(chapters)s::text[], %(scenes)s::text[]) AS t(c, sc)) t"
    " CROSS JOIN LATERAL (SELECT k.chapter_id, k.scene_id, k.position FROM scenes k WHERE k.book_id = b.book_id"
    "  AND k.chapter_id = t.c AND k.scene_id = t.sc LIMIT 1) s"
)

# The terms a request id's commands were made from, and when scenes are named, how many targets its first command
# has and how many of the named scenes are among them (`resend.named_match`).
_FIRST_SENDING = (
    "SELECT c.book_id, array_agg(c.stage), bool_and(c.force), min(c.priority), min(c.requested_stages),"
    " bool_and(c.whole_book), {counts}"
    " FROM commands c WHERE c.request_id = %(request)s GROUP BY c.book_id"
)
# Each named scene looked up by key (the targets' primary key): a whole-book command of 100,000 targets is not read.
_NAMED_COUNTS = (
    "(SELECT f.target_count FROM commands f WHERE f.command_id = %(first)s::uuid),"
    " (SELECT count(*) FROM (SELECT DISTINCT c, sc FROM unnest(%(chapters)s::text[], %(scenes)s::text[]) AS n(c, sc)) n"
    "  WHERE EXISTS (SELECT 1 FROM command_targets t WHERE t.command_id = %(first)s::uuid AND t.chapter_id = n.c"
    "  AND t.scene_id = n.sc))"
)


class Catalog:
    def __init__(self, db: Database, registry: MediaRegistry) -> None:
        self.db = db
        self.registry = registry

    def import_book(self, book: Book) -> ImportSummary:
        """Create or update a book; only what changed is touched and nothing is queued. The scenes' input hashes
        are computed before the book's lock, and an unchanged scene is not written: every commit and claim of the
        book waits for that lock (they waited holding their lane's, and every book of the lane with them, until
        they took the book's first), through an import (the hashing of 100,000 scenes alone: 7.6 s)."""
        stages = list(self.registry.names())
        hashes = {(s.chapter_id, s.scene_id): scene_hashes(self.registry, s.text, s.prompt) for s in book.scenes}
        with self.db.transaction() as conn:
            lock_book(conn, book.book_id)
            created = (
                conn.execute(
                    "INSERT INTO books (book_id, title) VALUES (%s, %s) ON CONFLICT (book_id) DO UPDATE"
                    " SET title = EXCLUDED.title, updated_at = now() RETURNING (xmax = 0)",
                    (book.book_id, book.title),
                ).fetchone()
                or (False,)
            )[0]
            old = {
                (c, s): (t, p, position, known)
                for c, s, t, p, position, known in conn.execute(
                    "SELECT chapter_id, scene_id, text, prompt, position, input_hashes FROM scenes WHERE book_id = %s",
                    (book.book_id,),
                )
            }
            new_keys = {(s.chapter_id, s.scene_id) for s in book.scenes}
            removed = [key for key in old if key not in new_keys]
            # Every stage's pair of a removed scene, this process's stage table or not: a target of a stage it does
            # not know was left open, its command active for ever.
            removed_pairs = conn.execute(
                "SELECT a.chapter_id, a.scene_id, a.stage, a.state, a.dispatch_id FROM asset_states a"
                " JOIN unnest(%s::text[], %s::text[]) AS r(c, s) ON a.chapter_id = r.c AND a.scene_id = r.s"
                " WHERE a.book_id = %s",
                ([c for c, _ in removed], [s for _, s in removed], book.book_id),
            ).fetchall()
            with conn.cursor() as cur:
                cur.executemany(
                    "DELETE FROM scenes WHERE book_id = %s AND chapter_id = %s AND scene_id = %s",
                    [(book.book_id, c, s) for c, s in removed],
                )
                cur.execute(
                    "DELETE FROM chapters WHERE book_id = %s AND NOT (chapter_id = ANY(%s))",
                    (book.book_id, [c.chapter_id for c in book.chapters]),
                )
                cur.executemany(
                    "INSERT INTO chapters (book_id, chapter_id, position, title) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (book_id, chapter_id) DO UPDATE SET position = EXCLUDED.position,"
                    " title = EXCLUDED.title",
                    [(book.book_id, c.chapter_id, c.position, c.title) for c in book.chapters],
                )
                cur.executemany(
                    "INSERT INTO scenes (book_id, chapter_id, scene_id, position, text, prompt, input_hashes)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s)"
                    " ON CONFLICT (book_id, chapter_id, scene_id) DO UPDATE SET position = EXCLUDED.position,"
                    " text = EXCLUDED.text, prompt = EXCLUDED.prompt,"
                    # The hashes of stages this process does not know are kept while the scene's inputs are the same:
                    # an import from a shell with another stage table marked their ready media stale. Changed, they go.
                    " input_hashes = CASE WHEN scenes.text IS NOT DISTINCT FROM EXCLUDED.text"
                    "  AND scenes.prompt IS NOT DISTINCT FROM EXCLUDED.prompt"
                    "  THEN scenes.input_hashes || EXCLUDED.input_hashes ELSE EXCLUDED.input_hashes END",
                    [
                        (
                            book.book_id,
                            s.chapter_id,
                            s.scene_id,
                            s.position,
                            s.text,
                            s.prompt,
                            Jsonb(hashes[s.chapter_id, s.scene_id]),
                        )
                        for s in book.scenes
                        if _differs(
                            old.get((s.chapter_id, s.scene_id)),
                            s.text,
                            s.prompt,
                            s.position,
                            hashes[s.chapter_id, s.scene_id],
                        )
                    ],
                )
            self._ensure_asset_rows(conn, book.book_id, stages)
            dirtied: list[Pair] = [
                tuple(row)
                for row in conn.execute(
                    "UPDATE asset_states a SET state = %s, updated_at = now() FROM scenes s"
                    " WHERE a.book_id = %s AND s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
                    " AND s.scene_id = a.scene_id AND a.state = %s"
                    " AND a.input_hash IS DISTINCT FROM s.input_hashes ->> a.stage"
                    " RETURNING a.chapter_id, a.scene_id, a.stage",
                    (AssetState.DIRTY, book.book_id, AssetState.READY),
                )
            ]
            # A target of an active command can no longer progress when its scene is gone, or when the media
            # it was made was found stale: counted open for ever, it kept its command active (the book's lock,
            # taken above, is the one every settle holds).
            if removed or dirtied:
                gone = [(c, s, st) for c, s, st, _, _ in removed_pairs]
                mark_released(conn, book.book_id, {SCENE_REMOVED: gone, INPUT_CHANGED: dirtied})
            changed = sum(
                1
                for s in book.scenes
                if (s.chapter_id, s.scene_id) in old and old[s.chapter_id, s.scene_id][:2] != (s.text, s.prompt)
            )
            added = sum(1 for s in book.scenes if (s.chapter_id, s.scene_id) not in old)
            journal.record(
                conn, "book.imported", book.book_id, {"added": added, "changed": changed, "removed": len(removed)}
            )
        if added >= ANALYZE_FROM_ROWS:
            self.db.analyze("scenes", "asset_states")
        running = tuple(((c, s, st), d) for c, s, st, state, d in removed_pairs if state == AssetState.GENERATING and d)
        return ImportSummary(book.book_id, bool(created), added, changed, len(removed), len(dirtied), running)

    @staticmethod
    def _ensure_asset_rows(conn: psycopg.Connection, book_id: str, stages: list[str]) -> None:
        conn.execute(
            "INSERT INTO asset_states (book_id, chapter_id, scene_id, stage, position)"
            " SELECT s.book_id, s.chapter_id, s.scene_id, st, s.position FROM scenes s, unnest(%s::text[]) st"
            " WHERE s.book_id = %s ON CONFLICT DO NOTHING",
            (stages, book_id),
        )

    def command_context(self, book_id: str, named: list[tuple[str, str]] | None, request_id: str) -> CommandContext:
        params: dict[str, object] = {"request": request_id, "book": book_id}
        if named is None:
            scenes = _EVERY_SCENE
        else:
            scenes = _NAMED_SCENES
            params.update(chapters=[c for c, _ in named], scenes=[sc for _, sc in named])
        with self.db.read() as conn:
            row = conn.execute(_COMMAND_CONTEXT.format(scenes=scenes), params).fetchone()
            if row is None:
                return CommandContext(False, [], None, [])
            replay_of, first = list(row[1]), None
            if replay_of:  # a resend: what the first sending was, to hold this one to it
                counts = "NULL, NULL" if named is None else _NAMED_COUNTS
                terms = conn.execute(_FIRST_SENDING.format(counts=counts), {**params, "first": replay_of[0]}).fetchone()
                if terms is None:  # its commands were pruned meanwhile: a new request, as after the retention
                    replay_of = []
                else:
                    book, stages, force, priority, asked, whole_book, stored, found = terms
                    same = None if named is None else named_match(stored, named, found)
                    first = FirstSending(
                        book,
                        frozenset(stages),
                        force,
                        Priority(priority),
                        same,
                        None if asked is None else spelled_out(asked, list(self.registry.names())),
                        whole_book,
                    )
        return CommandContext(True, [(c, sc) for c, sc in row[2]], row[0], replay_of, first)

    def book_exists(self, book_id: str) -> bool:
        with self.db.read() as conn:
            return conn.execute("SELECT 1 FROM books WHERE book_id = %s", (book_id,)).fetchone() is not None

    def change_layers(self, book_id: str, changes: Mapping[str, bool]) -> tuple[str, list[Pair]] | None:
        """The book's layer config with `changes` ({stage: enabled}) made, read and written under the book's row
        lock, and the `pending` pairs of the stages turned off released to `dirty` (`released.release_stages`) in
        the same transaction; None: no such book. *Why:* rebuilt from this process's stage table and written over,
        the setting of a stage only another table has was dropped (a layer turned off came back on), and of two
        changes made at once the last undid the first. *Why the release here, under the book's lock:* a claim
        (`AssetStore.claiming`) takes that lock and then compares-and-sets on `pending`; a change committed
        between a pass's decision and its claim, the release left to the change's own pass after it, had the claim
        dispatch and queue the stage's pairs with the layer off. Returns the new config and the released pairs."""
        with self.db.transaction() as conn:
            lock_book(conn, book_id)  # a claim of the book comes wholly before or after; then its row, as an import
            row = conn.execute(  # NO KEY: a foreign key check of a new command or chapter needs not wait
                "SELECT layer_config FROM books WHERE book_id = %s FOR NO KEY UPDATE", (book_id,)
            ).fetchone()
            if row is None:
                return None
            raw = changed_layers(row[0], changes)
            conn.execute("UPDATE books SET layer_config = %s, updated_at = now() WHERE book_id = %s", (raw, book_id))
            released = release_stages(conn, book_id, [stage for stage, enabled in changes.items() if not enabled])
        return raw, released

    def layers(self, book_id: str) -> str | None:
        with self.db.read() as conn:
            row = conn.execute("SELECT layer_config FROM books WHERE book_id = %s", (book_id,)).fetchone()
        return None if row is None else row[0]


def _differs(
    stored: tuple[str | None, str | None, int, dict[str, str]] | None,
    text: str | None,
    prompt: str | None,
    position: int,
    ours: dict[str, str],
) -> bool:
    """Whether the scene's row must be written: new, moved, changed, or lacking a hash this stage table makes."""
    if stored is None:
        return True
    old_text, old_prompt, old_position, known = stored
    return (old_text, old_prompt, old_position) != (text, prompt, position) or any(
        known.get(stage) != value for stage, value in ours.items()
    )
