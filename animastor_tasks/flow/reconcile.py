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
from typing import Any

from animastor_tasks.domain.gate import BookFacts, decide
from animastor_tasks.domain.vocabulary import AssetState
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import dispatch, gate
from animastor_tasks.ports import Ports

log = logging.getLogger("animastor.reconcile")


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
    if dead:
        # A job still waiting in its queue has not started renewing its lease: it is alive.
        queued = ports.queue_probe.queued_dispatch_ids(registry.queues()) or set()
        waiting = [g for g in dead if g.dispatch_id is not None and g.dispatch_id in queued and g.stage in registry]
        ports.leases.take_leases(
            [((g.book, *g.pair), g.dispatch_id, registry.get(g.stage).lease_ttl, {}) for g in waiting if g.dispatch_id]
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
