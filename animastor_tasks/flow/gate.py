"""The gate pass: decide every active pair of one book, release what lost its authority,
and hand what is authorized to dispatch.

A pass reads Redis once (one pipeline) and Postgres in three queries, whatever the
number of scenes. Any read that fails authorizes nothing (fail-closed) and is logged.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import psycopg

from animastor_tasks.adapters.ledger import InFlight
from animastor_tasks.domain.fsm import AssetState
from animastor_tasks.domain.gate import BookFacts, Denial, Pair, decide
from animastor_tasks.domain.outcomes import Outcome
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import dispatch, telemetry
from animastor_tasks.flow.runtime import Runtime

log = logging.getLogger("animastor.gate")


@dataclass
class PassReport:
    book: str
    authorized: list[Pair] = field(default_factory=list)
    denied: dict[Pair, Denial] = field(default_factory=dict)
    released: list[Pair] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    dispatched: list[str] = field(default_factory=list)
    error: str | None = None


def gate_pass(rt: Runtime, book: str, *, dispatch_work: bool = True) -> PassReport:
    """One pass, timed into the `gate_pass_seconds` histogram when it changed something.

    Why only then: a pass over deferred pairs must stay free of writes; one that released or
    dispatched pairs writes anyway, and its duration is the one operators need to watch.
    """
    started = time.monotonic()
    report = _gate_pass(rt, book, dispatch_work=dispatch_work)
    if report.released or any(outcome != Outcome.DEFERRED for outcome in report.outcomes):
        telemetry.observe(rt, "gate_pass_seconds", time.monotonic() - started)
    return report


def _gate_pass(rt: Runtime, book: str, *, dispatch_work: bool = True) -> PassReport:
    report = PassReport(book)
    now = time.time()
    try:
        snap = rt.coord.book_snapshot(book, now, rt.settings.registry.queues())
    except StoreUnavailable as err:
        report.error = str(err)
        log.warning("[COMMAND-GATE] book=%r coordination unreadable, nothing authorized: %s", book, err)
        return report
    try:
        rows = rt.ledger.gate_rows(book)
    except (StoreUnavailable, psycopg.Error) as err:
        report.error = str(err)
        log.warning("[COMMAND-GATE] book=%r registry unreadable, nothing authorized: %s", book, err)
        return report
    if rows is None:
        log.warning("[COMMAND-GATE] book=%r unknown; removed from the active index", book)
        rt.coord.deactivate(book, snap.active)
        rt.coord.drop_book_if_idle(book)
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
        report.released = rt.ledger.move_pairs(book, to_release, AssetState.PENDING, AssetState.DIRTY, "gate.released")
        rt.coord.clear_deferrals(book, report.released)
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
        rt.coord.deactivate(book, idle)
        if not busy:
            rt.coord.drop_book_if_idle(book)

    if dispatch_work and pending:
        result = dispatch.dispatch_pending(rt, book, pending, snap, now=now)
        report.outcomes = result.outcomes
        report.dispatched = result.dispatched
    return report


def _describe(denied: dict[Pair, Denial], pairs: list[Pair]) -> str:
    shown = [f"{c}/{s}:{st}={denied.get((c, s, st), '?')}" for c, s, st in pairs[:5]]
    more = f" (+{len(pairs) - 5} more)" if len(pairs) > 5 else ""
    return ", ".join(shown) + more
