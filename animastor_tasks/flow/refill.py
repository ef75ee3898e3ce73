"""The refill: a slot freed, so the next waiting pairs of one book are dispatched, at a cost that
follows the free slots and not the size of the book.

A full gate pass (flow/gate.py) reads every in-flight pair of its book; a book of thousands of
scenes made every freed slot cost thousands of rows. A refill reads only the book's first few
pending pairs of the freed lane, in the order they should get slots (one SQL statement), and
what Redis knows of those pairs (one pipeline), decides them with the same gate rule, and hands
them to the same dispatch. It releases nothing: a candidate the gate denies is left to the book's
full pass, which is asked for at once.
"""

from __future__ import annotations

import logging
import time

from animastor_tasks.domain.gate import BookFacts, decide
from animastor_tasks.domain.vocabulary import DeferralBucket
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import dispatch, gate
from animastor_tasks.ports import InFlight, Ports

log = logging.getLogger("animastor.gate")
MAX_ROUNDS = 8  # reads of one refill while every candidate it read was claimed (the lane had room for more)


def refill(ports: Ports, book: str, lane: str | None = None) -> gate.PassReport:
    """Dispatch the book's next pairs for a freed slot of `lane` (None: of any lane, as when the book's
    own job ended and its scene window moved). A slot the book has no use for is handed on."""
    report = gate.PassReport(book)
    try:
        _refill(ports, book, lane, report)
    except StoreUnavailable as err:
        report.error = str(err)
        log.warning("[COMMAND-GATE] book=%r refill failed, nothing authorized: %s", book, err)
    if lane is not None and lane not in report.claimed_lanes:
        gate.pass_on_slot(ports, book, lane)
    return report


def free_slot(ports: Ports, book: str, queue: str, dispatch_id: str, *, here: bool = False) -> None:
    """A job of `book` ended and its slot is free, now: the book that waited longest for the lane gets it
    and `book` queues behind the waiters at the priority its job was dispatched with (both in one atomic
    step); with nobody waiting, the book's own pairs waiting for capacity go.

    `here` (a job that ended ready): the refill runs in the process whose job ended, so the slot waits
    for no control-queue hop; a refill that fails here is sent to the control worker. Otherwise (a job
    that failed or gave its pair back) it is sent at once: a pair given back is not re-run in a tight loop."""
    waiters = ports.deferrals.next_waiters(queue, 1, exclude=book, requeue_from=dispatch_id)
    if waiters:
        _refill_for(ports, waiters[0], queue, here)
        return
    # Every stage: the scene window is shared by the book's stages, so a finished audio job
    # can free the slot an image pair was deferred for (window_full).
    ports.deferrals.clear_bucket(book, DeferralBucket.CAPACITY)
    _refill_for(ports, book, None, here)


def _refill_for(ports: Ports, book: str, lane: str | None, here: bool) -> None:
    if here:
        try:
            if refill(ports, book, lane).error is None:
                return
        except Exception as err:  # the control worker tries again; the job itself is done
            log.warning("[COMMAND-GATE] book=%r refill after a job failed here, sent on: %s", book, err)
    ports.publisher.enqueue_refill(book, lane)


def candidate_limit(lane_limits: list[int]) -> int:
    """Enough candidates to fill every slot of the lanes twice over: pairs the dispatch skips (deferred,
    already done) rarely outnumber the slots, and a refill that claims all it read reads again."""
    return max(16, min(256, 2 * sum(lane_limits)))


def _refill(ports: Ports, book: str, lane: str | None, report: gate.PassReport) -> None:
    registry = ports.settings.registry
    specs = [s for s in registry.stages if lane is None or s.queue == lane]
    limit = candidate_limit([s.lane_limit for s in specs])
    queues = registry.queues()
    for _ in range(MAX_ROUNDS):
        started, now = time.monotonic(), time.time()
        rows = ports.assets.gate_candidates(book, [s.name for s in specs], limit)
        if rows is None or (lane is None and not rows.in_flight and not report.authorized):
            # The book is gone, or its own job ended with nothing of it pending: the full pass is cheap
            # then, and it is the one that deactivates finished scenes and takes the book off the indexes.
            full = gate.gate_pass(ports, book)
            report.outcomes.update(full.outcomes)
            report.dispatched.extend(full.dispatched)
            report.claimed_lanes |= full.claimed_lanes
            return
        if not rows.in_flight:
            return
        snap = ports.book_state.pair_snapshot(book, [i.pair for i in rows.in_flight], now, queues)
        facts = BookFacts(True, snap.cancel_flag, rows.tombstone, rows.layers_raw, rows.commanded)
        authorized: list[InFlight] = []
        for item in rows.in_flight:
            reason = decide(facts, item.pair)
            if reason is None:
                authorized.append(item)
            else:
                report.denied[item.pair] = reason
        report.authorized.extend(i.pair for i in authorized)
        result = dispatch.dispatch_pending(ports, book, authorized, snap, now=now, handed_lane=lane)
        report.outcomes.update(result.outcomes)
        report.dispatched.extend(result.dispatched)
        report.claimed_lanes |= result.claimed_lanes
        if result.dispatched:
            ports.counters.observe("gate_pass_seconds", time.monotonic() - started)
        _schedule(ports, book, bool(report.denied), min(result.deferred_until.values(), default=None), snap.due_at)
        if report.denied or len(result.dispatched) < len(rows.in_flight) or len(rows.in_flight) < limit:
            return


def _schedule(ports: Ports, book: str, denied: bool, deferred_until: float | None, due_at: float | None) -> None:
    """A denied candidate asks for the book's full pass now (it releases the pair); a deferral this
    refill wrote brings the book's next pass forward if the due index had it later. Never removed
    here: the pairs a refill did not read are still waiting."""
    due = time.time() if denied else deferred_until
    if due is None or (due_at is not None and due_at <= due):
        return
    try:
        ports.book_state.set_due(book, due)
    except StoreUnavailable as err:  # reconcile's pass over every book with work puts it back
        log.warning("[COMMAND-GATE] book=%r due index not written: %s", book, err)
