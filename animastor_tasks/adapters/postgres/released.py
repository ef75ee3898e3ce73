"""Targets released to `dirty` (their scene removed, their layer off, no worker, Stop All): marked on their
commands, journalled, and the book's commands settled, in the caller's transaction."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

from animastor_tasks.adapters.postgres import journal, literals
from animastor_tasks.adapters.postgres.settle import settle_commands
from animastor_tasks.domain.gate import BookFacts
from animastor_tasks.domain.targets import release_reason
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import AssetState, CommandStatus

ACTIVE = str(CommandStatus.ACTIVE)


def release_targets(
    conn: psycopg.Connection[Any],
    book: str,
    pairs: Sequence[Pair],
    reason: str | None = None,
    *,
    also: Sequence[str] = (),
) -> dict[str, int]:
    """Pairs just released to `dirty`, in the caller's transaction (holding `lock_book`): the targets
    active commands (and the commands `also` names) have on them are marked released, then the book's
    commands are settled. Returns the marked targets by reason.

    Without `reason` it is judged per pair from the book's Postgres facts (`domain.targets.release_reason`):
    a release the facts do not explain (the Redis cancel flag) or a tombstoned book marks nothing, since
    Stop All ends its commands itself.
    """
    if not pairs:
        return {}
    if reason is not None:
        return mark_released(conn, book, {reason: pairs}, also=also)
    row = conn.execute(
        "SELECT b.layer_config, EXISTS (SELECT 1 FROM cancel_tombstones t WHERE t.book_id = b.book_id)"
        " FROM books b WHERE b.book_id = %s",
        (book,),
    ).fetchone()
    if row is None:
        return {}
    facts = BookFacts(True, False, bool(row[1]), row[0], frozenset(pairs))
    by_reason: dict[str, list[Pair]] = defaultdict(list)
    for pair in pairs:
        why = release_reason(facts, pair)
        if why is not None:
            by_reason[why].append(pair)
    return mark_released(conn, book, by_reason, also=also)


def mark_released(
    conn: psycopg.Connection[Any],
    book: str,
    by_reason: Mapping[str, Sequence[Pair]],
    *,
    also: Sequence[str] = (),
) -> dict[str, int]:
    """Pairs released to `dirty` for known reasons (`release_targets`), several reasons in one go: their targets
    marked, one journal event, the book's commands settled once. Returns the marked targets by reason."""
    marked: dict[str, int] = {}
    for why, group in by_reason.items():
        if not group:
            continue
        chapters, scenes, stages = [p[0] for p in group], [p[1] for p in group], [p[2] for p in group]
        marked[why] = conn.execute(
            "UPDATE command_targets t SET released = %s FROM commands c,"
            " unnest(%s::text[], %s::text[], %s::text[]) AS p(c, s, st)"
            " WHERE c.command_id = t.command_id AND c.book_id = %s"
            " AND (c.status = %s OR c.command_id = ANY(%s::uuid[]))"
            " AND t.chapter_id = p.c AND t.scene_id = p.s AND t.stage = p.st AND t.released IS NULL",
            (why, chapters, scenes, stages, book, ACTIVE, list(also)),
        ).rowcount
    if any(marked.values()):
        journal.record(conn, "targets.released", book, {k: v for k, v in marked.items() if v})
    settle_commands(conn, book)
    return marked


def released_pending(conn: psycopg.Connection[Any], book: str, moved: Sequence[Pair]) -> None:
    """Pairs just moved `pending -> dirty` by a gate's judgement (`AssetStore.release_denied`, a layer turned off):
    journalled, their targets marked by reason and the book's commands settled (`release_targets`)."""
    if moved:
        journal.record(conn, "gate.released", book, {"pairs": len(moved), "from": "pending", "to": "dirty"})
    release_targets(conn, book, moved)


def release_stages(conn: psycopg.Connection[Any], book: str, stages: Sequence[str]) -> list[Pair]:
    """Every `pending` pair of the book's `stages` to `dirty` (`released_pending`), in the caller's transaction
    (holding `lock_book`): the pairs of a layer turned off."""
    if not stages:
        return []
    rows = conn.execute(
        "UPDATE asset_states SET state = %s, updated_at = now()"
        f" WHERE book_id = %s AND stage = ANY(%s) AND state = {literals.PENDING}"
        " RETURNING chapter_id, scene_id, stage",
        (AssetState.DIRTY, book, list(stages)),
    ).fetchall()
    moved: list[Pair] = [tuple(r) for r in rows]
    released_pending(conn, book, moved)
    return moved
