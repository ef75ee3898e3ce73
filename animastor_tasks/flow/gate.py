"""The gate pass: decide every active pair of one book, release what lost its authority,
and hand what is authorized to dispatch (the rule for one page of pairs is `page.py`'s).

A pass reads Postgres once (one statement) and Redis once (one pipeline), whatever the number
of scenes, up to `page.PAGE` pairs in flight (one outside a tick's batch first asks the size of the
active index); a bigger book is passed page by page (`paged_pass.py`), so that a pass's memory
stays bounded. Any read that fails authorizes nothing (fail-closed) and is logged. Each pass keeps
its book's place in the due index (when its next pass is needed); the beat's tick passes only the
books that are due, several per task, so an idle book costs nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from functools import partial

from animastor_tasks.domain import liveness
from animastor_tasks.domain.vocabulary import Outcome
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import candidates, collector, lanes, page, paged_pass, read_ahead, rebuild, takeover
from animastor_tasks.flow.page import PassReport
from animastor_tasks.flow.pass_hold import PassHold
from animastor_tasks.ports import GateRows, Ports, Snapshot

log = logging.getLogger("animastor.gate")
READ_AHEAD_BOOKS = 10  # books of a batch whose facts are read together (kept small: facts age while passes run)
OVERLAP_PAIRS = 1000  # from this many pairs (by the active index) a pass reads Redis and Postgres at once
Facts = tuple[Snapshot, GateRows | None]
__all__ = ["PassReport", "gate_batch", "gate_pass", "pass_on_slot", "tick"]


def gate_pass(
    ports: Ports,
    book: str,
    *,
    dispatch_work: bool = True,
    full_lanes: Collection[str] = (),
    known: Facts | None = None,
    snapshot: Snapshot | None = None,
) -> PassReport:
    """One pass, timed into the `gate_pass_seconds` histogram when it changed something.

    Why only then: a pass over deferred pairs must stay free of writes; one that released or
    dispatched pairs writes anyway, and its duration is the one operators need to watch.
    `full_lanes`: queues the caller saw without room, `known`: the book's snapshot and rows read with other
    books' (see `gate_batch`), `snapshot`: its snapshot alone, read with the caller's own writes (a regenerate).
    """
    started = time.monotonic()
    with collector.paused():
        report = _gate_pass(
            ports, book, dispatch_work=dispatch_work, full_lanes=full_lanes, known=known, snapshot=snapshot
        )
    if report.released or any(outcome != Outcome.DEFERRED for outcome in report.outcomes):
        ports.counters.observe("gate_pass_seconds", time.monotonic() - started)
    return report


def pass_on_slot(ports: Ports, book: str, lane: str, slots: int = 1) -> None:
    """Free slots of `lane` handed to `book`, which had no use for them: to the next waiting books rather than idle."""
    try:
        lanes.hand_over(ports, lane, slots, exclude=book)
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] book=%r could not pass on a free slot of %s: %s", book, lane, err)


def _gate_pass(
    ports: Ports,
    book: str,
    *,
    dispatch_work: bool,
    full_lanes: Collection[str],
    known: Facts | None,
    snapshot: Snapshot | None,
) -> PassReport:
    report = PassReport(book)
    now = ports.clock()
    if known is not None:
        snap, rows = known
    else:
        snap_ahead: Future[Snapshot] | None = None
        try:
            # A book whose active scenes may hold more pairs than a page goes to the pages at once: a limited
            # read that finds too many rows is thrown away (a tenth of the pass of a book of 100k pairs).
            scenes = ports.book_state.active_scene_count(book) if snapshot is None else len(snapshot.active)
            pairs = scenes * len(ports.settings.registry.stages)
            # Its snapshot is read while its rows come back (unless the caller read it already).
            if snapshot is None and OVERLAP_PAIRS <= pairs <= page.PAGE:
                snap_ahead = read_ahead.submit(partial(_snapshot, ports, book, now))
            read = None if pairs > page.PAGE else ports.assets.gate_rows_many([book], limit=page.PAGE)
        except StoreUnavailable as err:
            report.error = str(err)
            log.warning("[COMMAND-GATE] book=%r registry unreadable, nothing authorized: %s", book, err)
            return report
        if read is None:  # more pairs in flight than a pass holds: the free slots first, in order; then pages
            _paged(ports, report, dispatch_work=dispatch_work, full_lanes=set(full_lanes), now=now)
            return report
        rows = read[book]
        try:
            if snapshot is not None:
                snap = snapshot
            elif snap_ahead is not None:
                snap = snap_ahead.result()
            else:
                snap = _snapshot(ports, book, now)
        except StoreUnavailable as err:
            report.error = str(err)
            log.warning("[COMMAND-GATE] book=%r coordination unreadable, nothing authorized: %s", book, err)
            return report
    if rows is None:
        log.warning("[COMMAND-GATE] book=%r unknown; removed from the active index", book)
        ports.book_state.deactivate(book, snap.active)
        ports.book_state.drop_book_if_idle(book)
        return report

    waiting, result = page.pass_rows(
        ports,
        report,
        snap,
        rows,
        dispatch_work=dispatch_work,
        full_lanes=full_lanes,
        now=now,
    )
    ended = set(report.released) | result.settled
    # A stage BLOCKED in this pass released every pair of it in flight, and a pair settled as already completed is
    # `ready`: counted busy, the book stayed active for good (a regenerate without force of a finished book left its
    # scenes in the active index and their deferrals behind, which no tick nor reconcile visits again).
    busy = {i.pair[:2] for i in rows.in_flight if i.pair not in ended and i.stage not in result.blocked}
    idle = snap.active - busy
    if idle:
        ports.book_state.deactivate(book, idle)
        if not busy:
            ports.book_state.drop_book_if_idle(book)
    try:
        page.write_due(ports, book, page.next_due(snap, waiting, result.deferred_until, now), snap.due_at)
    except StoreUnavailable as err:
        report.error = str(err)
        log.warning("[COMMAND-GATE] book=%r due index not written, the book is due again: %s", book, err)
    return report


def _snapshot(ports: Ports, book: str, now: float) -> Snapshot:
    return ports.book_state.book_snapshots([book], now, ports.settings.registry.queues())[book]


def _paged(ports: Ports, report: PassReport, *, dispatch_work: bool, full_lanes: set[str], now: float) -> None:
    """A book too big for one page: its next candidates take the free slots in reading order, then the pages
    decide the rest (the lanes those candidates filled cost them no claim). The lanes the caller saw full are
    the caller's to count again (`gate_batch`)."""
    given = set(full_lanes)
    if dispatch_work:
        first = PassReport(report.book)  # the pages decide and count every pair, these ones included
        try:
            candidates.dispatch_candidates(ports, first, report.book, None)
        except StoreUnavailable as err:
            report.error = str(err)
            log.warning("[COMMAND-GATE] book=%r candidates unreadable, nothing dispatched: %s", report.book, err)
            return
        report.dispatched.extend(first.dispatched)
        report.claimed_lanes |= first.claimed_lanes
        report.outcomes.update({o: n for o, n in first.outcomes.items() if o != Outcome.DEFERRED})
        full_lanes |= page.lanes_without_room(ports)
    seen_full = paged_pass.run(ports, report, dispatch_work=dispatch_work, full_lanes=full_lanes, now=now)
    if seen_full - given:
        # Counted without a lock, these lanes' pairs waited without a claim: a job that ended before the book
        # joined their waiting lists found nobody to hand its slot to. Counted again now that it waits.
        lanes.hand_on_freed(ports, seen_full - given)


def tick(ports: Ports) -> list[str]:
    """Take over lapsed leases and block worker-less stages (flow/takeover.py), rebuild the books with work into
    the due index after a Redis loss (`rebuild.after_a_loss`), hand on free slots whose refill was lost
    (`lanes.hand_on_stranded`), then send the gate passes of the books that are due (the due index), several per
    task; a second beat's tick is skipped.
    A book with nothing to do is not in the index, so it costs the tick nothing."""
    if not ports.locks.try_lock("tick", ports.settings.tick_seconds * liveness.PERIODIC_LOCK_SHARE):
        return []
    started = time.monotonic()
    takeover.on_tick(ports)
    try:
        rebuild.after_a_loss(ports)  # Redis lost its data: its books due now, not at reconcile's next pass
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] not checked for a Redis loss this tick: %s", err)
    lanes.hand_on_stranded(ports)
    books = lanes.send_due_passes(ports)
    ports.counters.observe("tick_seconds", time.monotonic() - started)
    return books


def gate_batch(ports: Ports, books: Sequence[str], *, dispatch_work: bool = True) -> list[PassReport]:
    """The passes of several due books in one task. Each lane's room is counted once for the batch
    (no lock); a lane without room costs its books no claim transaction and no advisory lock.
    `dispatch_work=False`: reconcile's passes, which release and judge but dispatch nothing."""
    if not dispatch_work:
        return _passes(ports, books, dispatch_work=False, hold=None)
    with PassHold(ports, books) as hold:  # the passes are sent again should this batch's worker die
        return _passes(ports, books, dispatch_work=True, hold=hold)


def _passes(ports: Ports, books: Sequence[str], *, dispatch_work: bool, hold: PassHold | None) -> list[PassReport]:
    full = page.lanes_without_room(ports) if dispatch_work else set()
    reports: list[PassReport] = []
    failed: list[str] = []
    for first in range(0, len(books), READ_AHEAD_BOOKS):
        group = [b for b in books[first : first + READ_AHEAD_BOOKS] if hold is None or not hold.gave_up(b)]
        with collector.paused():
            read = _read_facts(ports, group)
        for book in group:
            if hold is not None and not hold.starts(book):  # given to the tick while a pass before it stalled
                continue
            try:
                report: PassReport | None = gate_pass(
                    ports, book, dispatch_work=dispatch_work, full_lanes=full, known=read.get(book)
                )
            except StoreUnavailable as err:  # one book's store error must not cost the others their pass
                log.warning("[COMMAND-GATE] book=%r pass failed: %s", book, err)
                failed.append(book)
                report = None
            if hold is not None:
                hold.ended(book)
            if report is None:
                continue
            reports.append(report)
            if report.error is not None:
                failed.append(book)
    if failed:
        # Taken off the due index to be passed here: the next tick passes them again. *Why:* they waited for
        # reconcile's round (30 s, or several), pairs a takeover had just made pending among them, slots idle.
        lanes.due_again(ports, failed, ports.clock())
    if full:
        lanes.hand_on_freed(ports, full)
    return reports


def _read_facts(ports: Ports, books: Sequence[str]) -> dict[str, Facts]:
    """The rows (one SQL statement) and snapshots (one Redis pipeline) of several books. Unreadable, or
    more pairs in flight than one pass holds: none, and each pass reads (and fails closed) on its own.
    Facts read a little earlier are as safe as a pass's own: every claim is a compare-and-set on
    `pending`, and a job re-checks the gate at its start."""
    try:
        rows = ports.assets.gate_rows_many(books, limit=page.PAGE)
        if rows is None:
            return {}
        snaps = ports.book_state.book_snapshots(books, ports.clock(), ports.settings.registry.queues())
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] facts of %d books unreadable; each pass reads its own: %s", len(books), err)
        return {}
    return {book: (snaps[book], rows[book]) for book in books}
