"""The beat's two duties: the tick (a gate task per active book) and reconcile.

Reconcile repairs, it never creates work: a `generating` pair with no live lease goes
back to `pending` if it is still authorized (else `dirty`), a stage whose queue lost
every consumer is BLOCKED, `pending` without authority is released, and after a Redis
loss the active index, cancel flags and layer mirrors are rebuilt from Postgres.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

from animastor_tasks.adapters.broker import queued_dispatch_ids
from animastor_tasks.domain.fsm import AssetState
from animastor_tasks.domain.gate import BookFacts, decide
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import dispatch, gate, telemetry
from animastor_tasks.flow.runtime import Runtime

log = logging.getLogger("animastor.reconcile")


def tick(rt: Runtime) -> list[str]:
    """Enqueue one gate task per book with active scenes; a second beat's tick is skipped."""
    if not rt.coord.try_lock("tick", rt.settings.tick_seconds * 0.8):
        return []
    started = time.monotonic()
    books = sorted(rt.coord.active_books())
    publisher = rt.require_publisher()
    for book in books:
        publisher.enqueue_gate(book)
    telemetry.observe(rt, "tick_seconds", time.monotonic() - started)
    return books


def reconcile(rt: Runtime, *, force: bool = False) -> dict[str, Any]:
    if not force and not rt.coord.try_lock("reconcile", rt.settings.reconcile_seconds * 0.8):
        return {"skipped": True}
    report: dict[str, Any] = {"rebuilt_books": 0, "expired": 0, "blocked": 0, "released": 0, "pruned_events": 0}
    books = rt.ledger.books_with_work()
    _rebuild_redis(rt, books, report)
    _expire_dead_generating(rt, report)
    _block_consumerless(rt, report)
    for book in books:
        report["released"] += len(gate.gate_pass(rt, book, dispatch_work=False).released)
    rt.coord.prune_deferrals(books, time.time())
    report["pruned_events"] = rt.ledger.prune_journal(rt.settings.journal_retention_days, rt.settings.journal_max_rows)
    if any(report[k] for k in ("expired", "blocked", "released")):
        log.info("[RECONCILE] %s", report)
    return report


def _rebuild_redis(rt: Runtime, books: list[str], report: dict[str, Any]) -> None:
    rt.coord.set_cancel_flags(rt.ledger.tombstoned_books())
    rt.coord.mirror_layers_many(rt.catalog.all_layers(books))
    for book in books:
        rows = rt.ledger.gate_rows(book)
        if rows is None:
            continue
        scenes = {(i.chapter, i.scene) for i in rows.in_flight}
        if scenes:
            rt.coord.activate(book, scenes)
            report["rebuilt_books"] += 1


def _expire_dead_generating(rt: Runtime, report: dict[str, Any]) -> None:
    generating = rt.ledger.generating_pairs()
    holders = rt.coord.lease_holders([(b, c, s, st) for b, c, s, st, _, _ in generating])
    dead = [row for row, holder in zip(generating, holders, strict=True) if holder is None]
    if dead:
        # A job still waiting in its queue has not started renewing its lease: it is alive.
        queued = queued_dispatch_ids(rt.settings.broker_url, rt.settings.registry.queues()) or set()
        waiting = [
            (b, c, s, st, d)
            for b, c, s, st, _, d in dead
            if d is not None and d in queued and st in rt.settings.registry
        ]
        rt.coord.take_leases(
            [((b, c, s, st), d, rt.settings.registry.get(st).lease_ttl, {}) for b, c, s, st, d in waiting]
        )
        dead = [row for row in dead if row[5] not in queued]
    facts_by_book: dict[str, BookFacts | None] = {}
    for book, chapter, scene, stage, token, _ in dead:
        if book not in facts_by_book:
            facts_by_book[book] = _facts(rt, book)
        facts = facts_by_book[book]
        authorized = facts is not None and decide(facts, (chapter, scene, stage)) is None
        target = AssetState.PENDING if authorized else AssetState.DIRTY
        if rt.ledger.expire_generating(book, (chapter, scene, stage), token, target):
            report["expired"] += 1
            log.warning(
                "[RECONCILE] book=%r chapter=%r scene=%r stage=%s token=%d lease gone: generating -> %s",
                book,
                chapter,
                scene,
                stage,
                token,
                target,
            )


def _facts(rt: Runtime, book: str) -> BookFacts | None:
    rows = rt.ledger.gate_rows(book)
    if rows is None:
        return None
    try:
        flag = rt.coord.cancel_flag_set(book)
    except StoreUnavailable:
        return None
    return BookFacts(True, flag, rows.tombstone, rows.layers_raw, rows.commanded)


def _block_consumerless(rt: Runtime, report: dict[str, Any]) -> None:
    """Jobs queued on a queue that lost every consumer: BLOCK their commands, neutralise the jobs."""
    by_stage: dict[str, set[str]] = defaultdict(set)
    for book, _, _, stage, _, _ in rt.ledger.generating_pairs():
        by_stage[stage].add(book)
    specs = [rt.settings.registry.get(s) for s in by_stage if s in rt.settings.registry]
    if not specs:
        return
    if time.time() - rt.coord.data_lost_at() < rt.settings.presence_ttl_seconds:
        return  # Redis lost its data moments ago: presence is not rebuilt yet, "no consumer" proves nothing
    counts = rt.consumers.counts([s.queue for s in specs])
    for spec in specs:
        if counts.get(spec.queue, 0) == 0:
            for book in sorted(by_stage[spec.name]):
                dispatch.block_stage(rt, book, spec)
                report["blocked"] += 1
