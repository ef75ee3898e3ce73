"""Two references for the gate benchmark: the same decisions as `gate_pass`, paid the legacy way.

- `per_pair_pass` (the original, kept for continuity): every store read repeated for every
  pair — cancel flag (Redis EXISTS), tombstone, layer config and covering command (three
  Postgres queries), and the pair's deferral (one Redis pipeline): 5 round trips per pair.
- `faithful_pass`: what the reference runtime really did — the cancel flag, the tombstone and
  the layer config read once per book per pass (memoized), the book's scenes in flight listed
  once (one query), the task state of a scene read once per scene (one query for both stages,
  with whether an active command covers each), and the deferral read once per pending pair:
  about 1.5 round trips per pair. This is the reference the issue asks the speedup against.

Both run their queries in one transaction on one pooled connection and one Redis client: the
most favourable set-up they can have. Both answer {authorized, denied, outcomes}, so the
benchmark checks that they decide exactly what `gate_pass` decides.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

_PER_SCENE_SQL = (
    "SELECT a.stage, a.state, s.position, EXISTS (SELECT 1 FROM command_targets t JOIN commands c"
    "  ON c.command_id = t.command_id WHERE t.book_id = a.book_id AND t.chapter_id = a.chapter_id"
    "  AND t.scene_id = a.scene_id AND t.stage = a.stage AND c.status = 'active')"
    " FROM asset_states a JOIN scenes s ON s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
    "  AND s.scene_id = a.scene_id"
    " WHERE a.book_id = %s AND a.chapter_id = %s AND a.scene_id = %s"
)


def _deferred(client: Any, keys: Any, book: str, pair: tuple[str, str, str], now: float) -> bool:
    """One Redis round trip: is the pair deferred in any bucket?"""
    from animastor_tasks.domain.keys import DEFER_BUCKETS, pair_member

    pipe = client.pipeline(transaction=False)
    member = pair_member(*pair)
    for bucket in DEFER_BUCKETS:
        pipe.zscore(keys.deferrals(book, bucket), member)
    return any(score is not None and float(score) > now for score in pipe.execute())


def per_pair_pass(rt: Any, book: str) -> dict[str, Any]:
    """The per-pair reference: 5 round trips per pair."""
    from animastor_tasks.domain.gate import BookFacts, decide

    client = rt.redis.client
    keys = rt.redis.keys
    now = time.time()
    authorized: list[tuple[str, str, str]] = []
    denied: dict[tuple[str, str, str], str] = {}
    outcomes: Counter[str] = Counter()
    with rt.db.transaction() as conn:
        in_flight = conn.execute(
            "SELECT a.chapter_id, a.scene_id, a.stage, a.state FROM asset_states a JOIN scenes s"
            " ON s.book_id = a.book_id AND s.chapter_id = a.chapter_id AND s.scene_id = a.scene_id"
            " WHERE a.book_id = %s AND a.state IN ('pending', 'generating') ORDER BY s.position",
            (book,),
        ).fetchall()
        for chapter, scene, stage, state in in_flight:
            pair = (chapter, scene, stage)
            flag = bool(client.exists(keys.cancel_flag(book)))
            tombstone = conn.execute("SELECT 1 FROM cancel_tombstones WHERE book_id = %s", (book,)).fetchone()
            layers = conn.execute("SELECT layer_config FROM books WHERE book_id = %s", (book,)).fetchone()
            commanded = conn.execute(
                "SELECT 1 FROM command_targets t JOIN commands c ON c.command_id = t.command_id"
                " WHERE t.book_id = %s AND t.chapter_id = %s AND t.scene_id = %s AND t.stage = %s"
                " AND c.status = 'active' LIMIT 1",
                (book, chapter, scene, stage),
            ).fetchone()
            facts = BookFacts(
                layers is not None,
                flag,
                tombstone is not None,
                None if layers is None else layers[0],
                frozenset({pair}) if commanded else frozenset(),
            )
            reason = decide(facts, pair)
            if reason is not None:
                denied[pair] = str(reason)
                continue
            authorized.append(pair)
            if state == "pending" and _deferred(client, keys, book, pair, now):
                outcomes["deferred_capacity"] += 1
    return {"authorized": authorized, "denied": denied, "outcomes": outcomes}


def faithful_pass(rt: Any, book: str) -> dict[str, Any]:
    """The reference runtime's pass: per book, per scene and per pair reads (~1.5 round trips per pair)."""
    from animastor_tasks.domain.gate import BookFacts, decide

    client = rt.redis.client
    keys = rt.redis.keys
    now = time.time()
    authorized: list[tuple[int, tuple[str, str, str]]] = []
    denied: dict[tuple[str, str, str], str] = {}
    outcomes: Counter[str] = Counter()
    with rt.db.transaction() as conn:
        # Memoized once per book per pass: cancel flag, tombstone, layer config.
        flag = bool(client.exists(keys.cancel_flag(book)))
        head = conn.execute(
            "SELECT b.layer_config, EXISTS (SELECT 1 FROM cancel_tombstones t WHERE t.book_id = b.book_id)"
            " FROM books b WHERE b.book_id = %s",
            (book,),
        ).fetchone()
        scenes = conn.execute(
            "SELECT DISTINCT a.chapter_id, a.scene_id FROM asset_states a"
            " WHERE a.book_id = %s AND a.state IN ('pending', 'generating')",
            (book,),
        ).fetchall()
        for chapter, scene in scenes:
            rows = conn.execute(_PER_SCENE_SQL, (book, chapter, scene)).fetchall()
            for stage, state, position, commanded in rows:
                if state not in ("pending", "generating"):
                    continue
                pair = (chapter, scene, stage)
                facts = BookFacts(
                    head is not None,
                    flag,
                    bool(head[1]) if head is not None else False,
                    None if head is None else head[0],
                    frozenset({pair}) if commanded else frozenset(),
                )
                reason = decide(facts, pair)
                if reason is not None:
                    denied[pair] = str(reason)
                    continue
                authorized.append((int(position), pair))
                if state == "pending" and _deferred(client, keys, book, pair, now):
                    outcomes["deferred_capacity"] += 1
    authorized.sort()
    return {"authorized": [pair for _, pair in authorized], "denied": denied, "outcomes": outcomes}


def same_decisions(ref: dict[str, Any], report: Any) -> bool:
    """The reference decided what the pass decided (as sets: the pass may order by priority first)."""
    return (
        set(ref["authorized"]) == set(report.authorized)
        and len(ref["authorized"]) == len(report.authorized)
        and ref["denied"] == {k: str(v) for k, v in report.denied.items()}
        and ref["outcomes"]["deferred_capacity"] == report.outcomes.get("deferred_capacity", 0)
    )
