"""Reconcile: the beat's repair pass (every 30 s).

It repairs, it never creates work: a `generating` pair with no live lease goes
back to `pending` if it is still authorized (else `dirty`), a stage whose queue lost
every consumer is BLOCKED, `pending` without authority is released, and after a Redis
loss the active index, cancel flags and layer mirrors are rebuilt from Postgres.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from animastor_tasks.domain import liveness
from animastor_tasks.domain.gate import BookFacts, decide
from animastor_tasks.domain.vocabulary import AssetState
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import dispatch, gate
from animastor_tasks.ports import GeneratingRow, Ports

log = logging.getLogger("animastor.reconcile")
RECOUNT_PAUSE_SECONDS = 0.5


def reconcile(ports: Ports, *, force: bool = False) -> dict[str, Any]:
    if not force and not ports.locks.try_lock("reconcile", ports.settings.reconcile_seconds * 0.8):
        return {"skipped": True}
    report: dict[str, Any] = {"rebuilt_books": 0, "expired": 0, "blocked": 0, "released": 0, "pruned_events": 0}
    books = ports.commands.books_with_work()
    _rebuild_redis(ports, books, report)
    _expire_dead_generating(ports, report)
    _block_consumerless(ports, report)
    for book in books:
        report["released"] += len(gate.gate_pass(ports, book, dispatch_work=False).released)
    ports.deferrals.prune_deferrals(books, time.time())
    report["pruned_events"] = ports.journal.prune_journal(
        ports.settings.journal_retention_days, ports.settings.journal_max_rows
    )
    if any(report[k] for k in ("expired", "blocked", "released")):
        log.info("[RECONCILE] %s", report)
    return report


def _rebuild_redis(ports: Ports, books: list[str], report: dict[str, Any]) -> None:
    ports.book_state.set_cancel_flags(ports.commands.tombstoned_books())
    ports.book_state.mirror_layers_many(ports.catalog.all_layers(books))
    for book in books:
        rows = ports.assets.gate_rows(book)
        if rows is None:
            continue
        scenes = {(i.chapter, i.scene) for i in rows.in_flight}
        if scenes:
            ports.book_state.activate(book, scenes)
            report["rebuilt_books"] += 1


def _expire_dead_generating(ports: Ports, report: dict[str, Any]) -> None:
    generating = ports.assets.generating_pairs()
    holders = ports.leases.lease_holders([(g.book, *g.pair) for g in generating])
    dead = [row for row, holder in zip(generating, holders, strict=True) if holder is None]
    registry = ports.settings.registry
    if generating:
        # A job still waiting in its queue has not started renewing its lease: it is alive, and
        # reconcile keeps its lease until it starts (domain/liveness.py).
        queued = _still_queued(ports, generating, holders)
        if queued is None:
            return  # the broker cannot be read: no evidence either way, the next pass decides
        ports.leases.restore_leases(
            [
                (
                    (g.book, *g.pair),
                    g.dispatch_id,
                    liveness.queued_lease_ttl(registry.get(g.stage).lease_ttl, ports.settings.reconcile_seconds),
                )
                for g in generating
                if g.dispatch_id is not None and g.dispatch_id in queued and g.stage in registry
            ]
        )
        dead = [g for g in dead if g.dispatch_id not in queued]
    facts_by_book: dict[str, BookFacts | None] = {}
    for g in dead:
        if g.book not in facts_by_book:
            facts_by_book[g.book] = _facts(ports, g.book)
        facts = facts_by_book[g.book]
        authorized = facts is not None and decide(facts, g.pair) is None
        target = AssetState.PENDING if authorized else AssetState.DIRTY
        if ports.assets.expire_generating(g.book, g.pair, g.token, target):
            report["expired"] += 1
            log.warning(
                "[RECONCILE] book=%r chapter=%r scene=%r stage=%s token=%d lease gone: generating -> %s",
                g.book,
                g.chapter,
                g.scene,
                g.stage,
                g.token,
                target,
            )


def _still_queued(ports: Ports, generating: Sequence[GeneratingRow], holders: Sequence[str | None]) -> set[str] | None:
    """The dispatch ids of `generating` pairs still waiting in their queue (domain/liveness.py); None when
    the broker cannot be read."""
    registry = ports.settings.registry
    rows = [(g, h) for g, h in zip(generating, holders, strict=True) if g.dispatch_id and g.stage in registry]
    if not rows:
        return set()
    queues = {registry.get(g.stage).queue for g, _ in rows}

    def look() -> tuple[set[str], set[str]]:
        """(waiting in their queue, lease-less dispatches the count says are gone although never delivered)."""
        listed = ports.queue_probe.queued_dispatch_ids(registry.queues())
        # The counts first, the markers after: a job taken in between is still counted, never missed.
        depths = None if listed is not None else ports.queue_probe.queue_depths(queues)
        marks = ports.leases.undelivered([g.dispatch_id or "" for g, _ in rows]) if depths is not None else []
        dispatches = [
            liveness.Dispatched(g.dispatch_id or "", registry.get(g.stage).queue, m)
            for (g, _), m in zip(rows, marks or [None] * len(rows), strict=True)
        ]
        queued = liveness.still_queued(dispatches, listed, depths)
        missing = {
            d.dispatch_id
            for d, (_, h) in zip(dispatches, rows, strict=True)
            if h is None and d.dispatched_at is not None and d.dispatch_id not in queued
        }
        return queued, missing

    try:
        queued, missing = look()
        if missing:
            # A job a worker took a moment ago is neither ready in its queue nor marked delivered yet:
            # look once more before taking a counted job for lost.
            time.sleep(RECOUNT_PAUSE_SECONDS)
            queued |= look()[0]
    except StoreUnavailable as err:
        log.warning("[RECONCILE] broker unreadable, no lease-less job expired this pass: %s", err)
        return None
    return queued


def _facts(ports: Ports, book: str) -> BookFacts | None:
    rows = ports.assets.gate_rows(book)
    if rows is None:
        return None
    try:
        flag = ports.book_state.cancel_flag_set(book)
    except StoreUnavailable:
        return None
    return BookFacts(True, flag, rows.tombstone, rows.layers_raw, rows.commanded)


def _block_consumerless(ports: Ports, report: dict[str, Any]) -> None:
    """Jobs queued on a queue that lost every consumer: BLOCK their commands, neutralise the jobs."""
    by_stage: dict[str, set[str]] = defaultdict(set)
    for g in ports.assets.generating_pairs():
        by_stage[g.stage].add(g.book)
    specs = [ports.settings.registry.get(s) for s in by_stage if s in ports.settings.registry]
    if not specs:
        return
    if time.time() - ports.book_state.data_lost_at() < ports.settings.presence_ttl_seconds:
        return  # Redis lost its data moments ago: presence is not rebuilt yet, "no consumer" proves nothing
    counts = ports.presence.counts([s.queue for s in specs])
    for spec in specs:
        if counts.get(spec.queue, 0) == 0:
            for book in sorted(by_stage[spec.name]):
                dispatch.block_stage(ports, book, spec)
                report["blocked"] += 1
