"""The gate pass: decide every active pair of one book, release what lost its authority,
and hand what is authorized to dispatch.

A pass reads Redis once (one pipeline) and Postgres once (one statement), whatever the
number of scenes. Any read that fails authorizes nothing (fail-closed) and is logged.
The beat's tick fans out one pass per book with active scenes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from animastor_tasks.domain.gate import BookFacts, Denial, decide
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import AssetState, Outcome
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import dispatch
from animastor_tasks.ports import InFlight, Ports

log = logging.getLogger("animastor.gate")


@dataclass
class PassReport:
    book: str
    authorized: list[Pair] = field(default_factory=list)
    denied: dict[Pair, Denial] = field(default_factory=dict)
    released: list[Pair] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    dispatched: list[str] = field(default_factory=list)
    claimed_lanes: set[str] = field(default_factory=set)
    error: str | None = None


def gate_pass(ports: Ports, book: str, *, dispatch_work: bool = True, handed_lane: str | None = None) -> PassReport:
    """One pass, timed into the `gate_pass_seconds` histogram when it changed something.

    Why only then: a pass over deferred pairs must stay free of writes; one that released or
    dispatched pairs writes anyway, and its duration is the one operators need to watch.
    """
    started = time.monotonic()
    report = _gate_pass(ports, book, dispatch_work=dispatch_work, handed_lane=handed_lane)
    if report.released or any(outcome != Outcome.DEFERRED for outcome in report.outcomes):
        ports.counters.observe("gate_pass_seconds", time.monotonic() - started)
    if handed_lane is not None and handed_lane not in report.claimed_lanes:
        # Handed a free slot it had no use for: pass it on rather than leave it idle.
        try:
            dispatch.hand_over(ports, handed_lane, 1, exclude=book)
        except StoreUnavailable as err:
            log.warning("[COMMAND-GATE] book=%r could not pass on a free slot of %s: %s", book, handed_lane, err)
    return report


def _gate_pass(ports: Ports, book: str, *, dispatch_work: bool, handed_lane: str | None) -> PassReport:
    report = PassReport(book)
    now = time.time()
    try:
        snap = ports.book_state.book_snapshot(book, now, ports.settings.registry.queues())
    except StoreUnavailable as err:
        report.error = str(err)
        log.warning("[COMMAND-GATE] book=%r coordination unreadable, nothing authorized: %s", book, err)
        return report
    try:
        rows = ports.assets.gate_rows(book)
    except StoreUnavailable as err:
        report.error = str(err)
        log.warning("[COMMAND-GATE] book=%r registry unreadable, nothing authorized: %s", book, err)
        return report
    if rows is None:
        log.warning("[COMMAND-GATE] book=%r unknown; removed from the active index", book)
        ports.book_state.deactivate(book, snap.active)
        ports.book_state.drop_book_if_idle(book)
        return report

    facts = BookFacts(True, snap.cancel_flag, rows.tombstone, rows.layers_raw, rows.commanded)
    pending: list[InFlight] = []
    for item in rows.in_flight:
        pair = (item.chapter, item.scene, item.stage)
        reason = decide(facts, pair)
        if reason is None:
            report.authorized.append(pair)
            if item.state == AssetState.PENDING:
                pending.append(item)
        else:
            report.denied[pair] = reason
    pending_pairs = {(i.chapter, i.scene, i.stage) for i in rows.in_flight if i.state == AssetState.PENDING}
    to_release = [p for p in report.denied if p in pending_pairs]
    if to_release:
        report.released = ports.assets.move_pairs(
            book, to_release, AssetState.PENDING, AssetState.DIRTY, "gate.released"
        )
        ports.deferrals.clear_deferrals(book, report.released)
        log.info(
            "[COMMAND-GATE] book=%r released %d pending pair(s) to dirty: %s",
            book,
            len(report.released),
            _describe(report.denied, report.released),
        )

    released = set(report.released)
    busy = {(i.chapter, i.scene) for i in rows.in_flight if (i.chapter, i.scene, i.stage) not in released}
    idle = snap.active - busy
    if idle:
        ports.book_state.deactivate(book, idle)
        if not busy:
            ports.book_state.drop_book_if_idle(book)

    if dispatch_work and pending:
        result = dispatch.dispatch_pending(ports, book, pending, snap, now=now, handed_lane=handed_lane)
        report.outcomes = result.outcomes
        report.dispatched = result.dispatched
        report.claimed_lanes = result.claimed_lanes
    return report


def tick(ports: Ports) -> list[str]:
    """Enqueue one gate task per book with active scenes; a second beat's tick is skipped."""
    if not ports.locks.try_lock("tick", ports.settings.tick_seconds * 0.8):
        return []
    started = time.monotonic()
    books = sorted(ports.book_state.active_books())
    for book in books:
        ports.publisher.enqueue_gate(book)
    ports.counters.observe("tick_seconds", time.monotonic() - started)
    return books


def _describe(denied: dict[Pair, Denial], pairs: list[Pair]) -> str:
    shown = [f"{c}/{s}:{st}={denied.get((c, s, st), '?')}" for c, s, st in pairs[:5]]
    more = f" (+{len(pairs) - 5} more)" if len(pairs) > 5 else ""
    return ", ".join(shown) + more
