"""The gate pass: decide every active pair of one book, release what lost its authority,
and hand what is authorized to dispatch.

A pass reads Redis once (one pipeline) and Postgres once (one statement), whatever the
number of scenes. Any read that fails authorizes nothing (fail-closed) and is logged.
Each pass keeps its book's place in the due index (when its next pass is needed); the beat's
tick passes only the books that are due, several per task, so an idle book costs nothing.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from animastor_tasks.domain.gate import BookFacts, Denial, decide
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import AssetState, Outcome
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import dispatch, takeover
from animastor_tasks.ports import GateRows, InFlight, Ports, Snapshot

log = logging.getLogger("animastor.gate")
BATCH_BOOKS = 50  # books per gate task sent by the tick
READ_AHEAD_BOOKS = 10  # books of a batch whose facts are read together (kept small: facts age while passes run)
Facts = tuple[Snapshot, GateRows | None]


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


def gate_pass(
    ports: Ports,
    book: str,
    *,
    dispatch_work: bool = True,
    full_lanes: Collection[str] = (),
    known: Facts | None = None,
) -> PassReport:
    """One pass, timed into the `gate_pass_seconds` histogram when it changed something.

    Why only then: a pass over deferred pairs must stay free of writes; one that released or
    dispatched pairs writes anyway, and its duration is the one operators need to watch.
    `full_lanes`: queues the caller saw without room, `known`: the book's snapshot and rows read with other
    books' (see `gate_batch`).
    """
    started = time.monotonic()
    report = _gate_pass(ports, book, dispatch_work=dispatch_work, full_lanes=full_lanes, known=known)
    if report.released or any(outcome != Outcome.DEFERRED for outcome in report.outcomes):
        ports.counters.observe("gate_pass_seconds", time.monotonic() - started)
    return report


def pass_on_slot(ports: Ports, book: str, lane: str) -> None:
    """A free slot of `lane` handed to `book`, which had no use for it: to the next waiting book rather than idle."""
    try:
        dispatch.hand_over(ports, lane, 1, exclude=book)
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] book=%r could not pass on a free slot of %s: %s", book, lane, err)


def _gate_pass(
    ports: Ports,
    book: str,
    *,
    dispatch_work: bool,
    full_lanes: Collection[str],
    known: Facts | None,
) -> PassReport:
    report = PassReport(book)
    now = time.time()
    try:
        queues = ports.settings.registry.queues()
        snap = ports.book_state.book_snapshots([book], now, queues)[book] if known is None else known[0]
    except StoreUnavailable as err:
        report.error = str(err)
        log.warning("[COMMAND-GATE] book=%r coordination unreadable, nothing authorized: %s", book, err)
        return report
    try:
        rows = ports.assets.gate_rows(book) if known is None else known[1]
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

    result = dispatch.DispatchResult()
    if dispatch_work and pending:
        result = dispatch.dispatch_pending(ports, book, pending, snap, now=now, full_lanes=full_lanes)
        report.outcomes = result.outcomes
        report.dispatched = result.dispatched
        report.claimed_lanes = result.claimed_lanes
    _schedule(ports, book, snap, [i for i in pending if i.pair not in result.gone], result.deferred_until, now)
    return report


def _schedule(
    ports: Ports, book: str, snap: Snapshot, waiting: list[InFlight], deferred: dict[Pair, float], now: float
) -> None:
    """Keep the book's place in the due index: its next pass is due when the first of its waiting pairs
    may go (the earliest deferral ends), now when one waits for no deferral (breaker, a Redis loss, a pass
    that dispatched nothing), and never while none waits (a job's end or a new command asks for a pass).

    Written only when the book must come sooner than the index says (or leave it): an earlier entry
    costs one cheap pass, and a pass over deferred pairs stays free of writes.
    """
    due: float | None = None
    if waiting:
        deferred_before = set().union(*snap.deferred.values())
        untouched = [i for i in waiting if i.pair not in deferred]
        ends = [deferred[i.pair] for i in waiting if i.pair in deferred]
        if any(i.pair not in deferred_before for i in untouched):
            ends.append(now)
        elif untouched:
            ends.append(now if snap.first_deferral_end is None else snap.first_deferral_end)
        due = min(ends)
    try:
        if due is None and snap.due_at is not None:
            ports.book_state.set_due(book, None)
        elif due is not None and (snap.due_at is None or due < snap.due_at):
            ports.book_state.set_due(book, due)
    except StoreUnavailable as err:  # reconcile's pass over every book with work puts it back
        log.warning("[COMMAND-GATE] book=%r due index not written: %s", book, err)


def tick(ports: Ports) -> list[str]:
    """Take over lapsed leases and block worker-less stages (flow/takeover.py), then send the gate passes
    of the books that are due (the due index), several per task; a second beat's tick is skipped.
    A book with nothing to do is not in the index, so it costs the tick nothing."""
    if not ports.locks.try_lock("tick", ports.settings.tick_seconds * 0.8):
        return []
    started = time.monotonic()
    takeover.on_tick(ports)
    books = ports.book_state.take_due(time.time())
    for first in range(0, len(books), BATCH_BOOKS):
        ports.publisher.enqueue_gates(books[first : first + BATCH_BOOKS])
    ports.counters.observe("tick_seconds", time.monotonic() - started)
    return books


def gate_batch(ports: Ports, books: Sequence[str]) -> list[PassReport]:
    """The passes of several due books in one task. Each lane's room is counted once for the batch
    (no lock); a lane without room costs its books no claim transaction and no advisory lock."""
    registry = ports.settings.registry
    try:
        load = ports.assets.lane_load(registry.names())
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] lane load unreadable, every pass counts its own: %s", err)
        load = {}
    full = {s.queue for s in registry.stages if load.get(s.name, 0) >= s.lane_limit}
    reports: list[PassReport] = []
    for first in range(0, len(books), READ_AHEAD_BOOKS):
        group = books[first : first + READ_AHEAD_BOOKS]
        read = _read_facts(ports, group)
        for book in group:
            try:
                reports.append(gate_pass(ports, book, full_lanes=full, known=read.get(book)))
            except StoreUnavailable as err:  # one book's store error must not cost the others their pass
                log.warning("[COMMAND-GATE] book=%r pass failed: %s", book, err)
    if full:
        _hand_on_freed(ports, full)
    return reports


def _read_facts(ports: Ports, books: Sequence[str]) -> dict[str, Facts]:
    """The snapshots (one Redis pipeline) and rows (one SQL statement) of several books. Unreadable: none,
    and each pass reads (and fails closed) on its own. Facts read a little earlier are as safe as a pass's
    own: every claim is a compare-and-set on `pending`, and a job re-checks the gate at its start."""
    try:
        snaps = ports.book_state.book_snapshots(books, time.time(), ports.settings.registry.queues())
        rows = ports.assets.gate_rows_many(books)
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] facts of %d books unreadable; each pass reads its own: %s", len(books), err)
        return {}
    return {book: (snaps[book], rows[book]) for book in books}


def _hand_on_freed(ports: Ports, full: set[str]) -> None:
    """Count the lanes seen full again, now that the batch's books have joined their waiting lists: a slot
    freed meanwhile (its job's end may have looked at a list before they joined) is handed on now."""
    stages = [s for s in ports.settings.registry.stages if s.queue in full]
    load = ports.assets.lane_load([s.name for s in stages])
    for spec in stages:
        if load.get(spec.name, 0) < spec.lane_limit:
            dispatch.hand_over(ports, spec.queue, spec.lane_limit - load.get(spec.name, 0))


def _describe(denied: dict[Pair, Denial], pairs: list[Pair]) -> str:
    shown = [f"{c}/{s}:{st}={denied.get((c, s, st), '?')}" for c, s, st in pairs[:5]]
    more = f" (+{len(pairs) - 5} more)" if len(pairs) > 5 else ""
    return ", ".join(shown) + more
