"""The refill: a slot freed, so the next waiting pairs of one book are dispatched, at a cost that
follows the free slots and not the size of the book (`candidates.py`).

A full gate pass (flow/gate.py) reads every in-flight pair of its book; a book of thousands of
scenes made every freed slot cost thousands of rows. A refill reads only the book's first few
pending pairs of the freed lane, and a slot it has no use for goes on to the next waiting book.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial

from animastor_tasks.domain.deferral import wait_score
from animastor_tasks.errors import BookBusy, StoreUnavailable
from animastor_tasks.flow import candidates, gate, lanes
from animastor_tasks.flow.page import PassReport
from animastor_tasks.ports import Committed, Ports

log = logging.getLogger("animastor.gate")


def refill(
    ports: Ports,
    book: str,
    lane: str | None = None,
    *,
    slots_of: str | None = None,
    slots: int = 1,
    batch: str | None = None,
) -> PassReport:
    """Dispatch the book's next pairs for a freed slot of `lane` (None: of any lane, as when the book's
    own job ended and its scene window moved). A slot the book has no use for is handed on.
    `slots_of`: the lane of the `slots` free slots this refill fills, at most (a job's own, see `free_slot`, or
    those `lanes.hand_over` handed it): with `lane` None, that lane's pairs are read even when the book's
    others come first in slot order. `batch`: the hand-over to several books this refill is one of."""
    try:
        return _refill(ports, book, lane, slots_of, slots)
    finally:
        if batch is not None and lane is not None:
            _close_hand_over(ports, batch, lane)


def _close_hand_over(ports: Ports, batch: str, lane: str) -> None:
    """The last refill of a hand-over to several books hands on what is still free of the lane, now that every
    one of them has claimed its share: a book that had no use for its share passed it to a waiting list its
    fellows were not back on yet, while one with more pairs than its share waited, beside the free slots."""
    try:
        last = ports.deferrals.close_hand_over(batch)
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] hand-over %s of %s not counted down: %s", batch, lane, err)
        return
    if last:
        lanes.hand_on_freed(ports, {lane})


def _refill(ports: Ports, book: str, lane: str | None, slots_of: str | None, slots: int) -> PassReport:
    report = PassReport(book)
    handed = lane or slots_of  # the lane whose slot the book was handed (lua/lane_take.lua noted it)
    began = ports.clock() + lanes.HANDED_CLOCK_SLACK
    try:
        read = candidates.dispatch_candidates(ports, report, book, lane, slots_of, slots)
        finished = read is None or (read == 0 and (lane is None or _nothing_pending(ports, book)))
        if read == 0 and handed is not None:  # its own slot's too: a place a failed refill kept (`_keep_place`)
            _leave_lanes(ports, book, ports.settings.registry.queues() if finished else (handed,))
        if finished:
            # The book is gone, or its own job ended with nothing of it pending (or it was handed a slot with
            # nothing left to claim): the full pass is cheap then, and it is the one that deactivates finished
            # scenes and takes the book off the indexes. *Why* the second: such a book never had a full pass,
            # and stayed in the active index for good.
            full = gate.gate_pass(ports, book)
            report.outcomes.update(full.outcomes)
            report.dispatched.extend(full.dispatched)
            report.claimed_lanes |= full.claimed_lanes
    except BookBusy as err:  # an import, a regenerate or a Stop All of the book: the slot is the next book's
        log.info("[COMMAND-GATE] book=%r refill: %s; the slot goes to the next waiting book", book, err)
        if handed is not None:
            _wait_behind(ports, book, handed)
            if handed not in report.claimed_lanes:  # an earlier round of this refill may have claimed it already
                gate.pass_on_slot(ports, book, handed, slots if slots_of == handed else 1)
            _hand_over_done(ports, book, handed, began)
        return report
    except StoreUnavailable as err:
        report.error = str(err)
        log.warning("[COMMAND-GATE] book=%r refill failed, nothing authorized: %s", book, err)
        if handed is not None:
            _keep_place(ports, book, handed)
            return report
    used = report.claimed_lanes | report.held_lanes
    if lane is not None and lane not in used:
        gate.pass_on_slot(ports, book, lane, slots if slots_of == lane else 1)
    elif lane is None and slots_of is not None and slots_of not in used:
        # Its own job's slot, found unused: nobody waited for the lane as the job ended, but a book whose refill was
        # on its way may be back on the list by now (it waited for the tick to find the lane stranded, two ticks).
        gate.pass_on_slot(ports, book, slots_of, 1)
    if handed is not None and not any(ports.settings.registry.get(s).queue == handed for s in report.claimed_stages):
        _hand_over_done(ports, book, handed, began)  # a claim of the lane's pairs took the record away already
    if report.unread:
        _pass_now(ports, book)
    return report


def _pass_now(ports: Ports, book: str) -> None:
    """A refill whose reads ran out with the lanes taking all they read asks for the book's pass at once, which reads
    every pending pair. *Why:* a book whose first pending pairs were hundreds done already (a regenerate without force
    of a book mostly ready) waited for the tick's pass, every slot of its lanes idle meanwhile. Due first: not sent,
    the tick passes it. One pass a tick at most: each job's end on a lane of 64 sent its own pass of the same big book
    (review). (A paged pass's own read of its first pairs needs neither: its pages read the rest.)"""
    try:
        ports.book_state.set_due(book, ports.clock())
        if ports.book_state.ask_pass(book, ports.settings.tick_seconds):
            ports.publisher.enqueue_gates([book])
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] book=%r pass not sent, left to the tick or reconcile: %s", book, err)


def _hand_over_done(ports: Ports, book: str, lane: str, began: float) -> None:
    """The record of a refill that claimed nothing of its lane (a claim took it away already, `dispatch`). Best
    effort: a record left behind only puts the book back on the waiting list two ticks later, which costs a refill;
    raised, it failed a refill whose claims were made, and its caller sent the refill again."""
    try:
        ports.deferrals.hand_over_done(lane, book, began)
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] book=%r hand-over record of %s not taken away: %s", book, lane, err)


def _leave_lanes(ports: Ports, book: str, queues: Sequence[str]) -> None:
    """A handed book with nothing pending of a lane leaves its waiting list (every list, with nothing pending at all),
    as a Stop All does. *Why:* a place kept for nothing (a takeover's, whose pair a pass then claimed)
    drew the next slot too, and bound the fair share of every book after it meanwhile. Best effort: left, the place
    costs one more hand-over."""
    try:
        ports.deferrals.leave_lanes(book, queues)
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] book=%r left on the waiting lists of %s: %s", book, ", ".join(queues), err)


def _wait_behind(ports: Ports, book: str, lane: str) -> None:
    """A busy book waits for the lane again at its most urgent pending pair's priority, behind the books waiting at
    that priority now (ahead of less urgent ones), and is due for the tick. *Why:* kept at the head, each next slot of
    the lane went to it, and waited for its lock in turn. Unreadable: the book's due pass puts it back on the list."""
    stages = [s.name for s in ports.settings.registry.stages if s.queue == lane]
    try:
        if (rank := candidates.most_urgent_rank(ports, book, stages)) is not None:
            ports.deferrals.wait_for_lane(lane, book, wait_score(rank, ports.clock()))
        ports.book_state.set_due(book, ports.clock())
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] book=%r not put back on the waiting list of %s: %s", book, lane, err)


def _keep_place(ports: Ports, book: str, lane: str) -> None:
    """A handed refill that could not read its book keeps its place at the head of the lane's waiting list, at the
    priority it was handed the slot with, due at once, rather than pass the slot on. *Why:* in a Postgres failover
    each next book's refill failed the same way, until every waiting book was off the list and the slot idle; the
    books came back only as their capacity deferrals ran out, in the order of their last refusal. The tick passes
    the book once the store answers. (At the head of the interactive priority, whatever it waited with, a bulk
    book went ahead of a reader's scene.) A book handed no record (its job's end left it nothing pending) gets no
    place, and one whose record a refill that failed before took away keeps the place that refill kept."""
    try:
        ports.deferrals.keep_handed_place(lane, book)
        ports.book_state.set_due(book, ports.clock())
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] book=%r place on %s not kept: %s", book, lane, err)


def free_slot(
    ports: Ports,
    book: str,
    queue: str,
    dispatch_id: str,
    *,
    left: Committed,
    here: bool = False,
    breaker_closed: bool = False,
    after: Callable[[Callable[[], None]], None] | None = None,
) -> None:
    """A job of `book` ended and its slot is free, now: the book that waited longest for the lane gets it
    and `book` queues behind the waiters at its most urgent pending pair's priority (both in one atomic
    step); with nobody waiting, the book's own pairs waiting for capacity go. A book whose pending pair is
    more urgent than every waiter keeps the slot for it (a free slot goes to the most urgent work waiting).
    `left`: what the job's commit, failure or give-back left the book of the lane (`Jobs.commit_job`); with nothing
    pending the book neither keeps the slot nor queues.

    `here` (a job that ended ready): the refill runs in the process whose job ended, so the slot waits
    for no control-queue hop, and it claims one pair of the lane at most: the slot this process freed
    (and may run the job of itself, `worker/chain.py`). Other free slots of the lane are those of jobs
    ending elsewhere, each refilled by its own process. A refill that fails here is sent to the control
    worker. Otherwise (a job that failed or gave its pair back) it is sent at once: a pair given back
    is not re-run in a tight loop. `breaker_closed`: the job's success closed the lane's open breaker, and the
    books that waited for it are passed at once (`lanes.breaker_closed`). `after`: where the clean-up of a book
    whose slot went to another goes (the job's bookkeeping held back until its process's next job has started,
    `job.Later`; given, it implies `here`): its read waits for nothing on the way to that start; by default it
    runs at once."""
    here = here or after is not None
    # Nobody waiting: the book's pairs deferred for capacity may go (the same atomic step clears them), of every
    # stage: the scene window is shared by the book's stages, so a finished audio job can free the slot an image
    # pair was deferred for (window_full).
    waiters = ports.deferrals.next_waiters(queue, 1, exclude=book, ended=(dispatch_id, left))
    if waiters:
        _refill_for(ports, waiters[0], queue, queue, here)  # `book` itself when it outranks the waiters
    else:
        _refill_for(ports, book, None, queue, here)
    if breaker_closed:
        lanes.breaker_closed(ports, queue)
    if waiters and waiters[0] != book:
        # The slot went to another book: one with nothing left pending leaves the active index (its own refill, with
        # nobody waiting, does that itself). *Why:* it only waited for a slot it had no use for, whose refill ran no
        # full pass, and the book stayed active for good.
        (after or _at_once)(partial(_leave_if_finished, ports, book))


def _at_once(step: Callable[[], None]) -> None:
    step()


def _refill_for(ports: Ports, book: str, lane: str | None, freed: str, here: bool) -> None:
    if here:
        try:
            if refill(ports, book, lane, slots_of=freed).error is None:
                return
        except Exception as err:  # the control worker tries again; the job itself is done
            log.warning("[COMMAND-GATE] book=%r refill after a job failed here, sent on: %s", book, err)
    ports.publisher.enqueue_refill(book, lane, freed=freed if lane is None else None, slots=None if lane is None else 1)


def _nothing_pending(ports: Ports, book: str) -> bool:
    """Whether the book has no pending pair an active command targets (one candidate read); unreadable: no."""
    try:
        rows = ports.assets.gate_candidates(book, ports.settings.registry.names(), 1)
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] book=%r pending pairs unreadable, taken as some: %s", book, err)
        return False
    return rows is not None and not rows.in_flight


def _leave_if_finished(ports: Ports, book: str) -> None:
    """A book with nothing pending gets its full pass: it deactivates the finished scenes and drops the book (cheap:
    it reads only the pairs still running). Failed, the book's next job end or reconcile's pass does it."""
    try:
        if _nothing_pending(ports, book):
            gate.gate_pass(ports, book)
    except Exception as err:  # the job's slot is handed on already; a failed clean-up must not fail the job's end
        log.warning("[COMMAND-GATE] book=%r left in the active index: %s", book, err)
