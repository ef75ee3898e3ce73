"""Dispatch from a book's next candidates: its first few pending pairs in the order they should get slots,
read with what decides them, at a cost that follows the free slots and not the size of the book.

Used by a refill (a slot freed, `refill.py`) and by the pass over a book too big to hold
(`paged_pass.py`), which must still fill the slots in reading order. It releases nothing: a candidate
the gate denies asks for the book's full pass at once (the due index), which releases it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import Outcome
from animastor_tasks.flow import dispatch, page
from animastor_tasks.flow.page import PassReport
from animastor_tasks.ports import Ports

MAX_ROUNDS = 8  # reads while every candidate read was claimed (the lanes had room for more)


def candidate_limit(lane_limits: list[int]) -> int:
    """Enough candidates to fill every slot of the lanes twice over: pairs the dispatch skips (deferred,
    already done) rarely outnumber the slots, and a read whose candidates were all claimed reads again."""
    return max(16, min(256, 2 * sum(lane_limits)))


def most_urgent_rank(ports: Ports, book: str, stages: Sequence[str]) -> int | None:
    """The priority rank of the book's most urgent pending pair of `stages` (each active command's first pending
    target weighs), as a job's end weighs its book (`Jobs.commit_job`); None: nothing pending (or no such book)."""
    rows = ports.assets.gate_candidates(book, stages, 1)
    return min((i.rank for i in rows.in_flight), default=None) if rows is not None else None


def dispatch_candidates(
    ports: Ports, report: PassReport, book: str, lane: str | None, slots_of: str | None = None, slots: int = 1
) -> int | None:
    """Dispatch the book's next pairs for `lane` (None: any of its lanes) into `report`; how many
    candidates were read (0: nothing pending), None for an unknown book. `slots_of`: see
    `dispatch.dispatch_pending`."""
    specs = [s for s in ports.settings.registry.stages if lane is None or s.queue == lane]
    # The slot a finished job freed in this process is this book's: its pairs that a concurrent claim
    # deferred for that lane (`lane_full`, past the claim's one slot) may take it.
    handed = lane if lane is not None else slots_of
    judged: set[Pair] = set()  # by a shorter read before a wider one, which starts from the first candidate again
    read, complete = _rounds(ports, report, book, specs, handed, (slots_of, slots), judged)
    if read is None:
        return None
    if lane is None and not complete and not report.denied:
        # A lane whose pairs were behind the book's others (an older command of another stage, its lane full) and
        # none came to a claim: its slots would idle while they wait. Its own pairs are read next: the freed lane's
        # (a job's end: the others' slots are other processes'), or every such lane's (a first pass: a regenerate's
        # of a big book left the audio lane idle until the tick). *Why weighed, not counted:* a read whose one pair
        # of the lane a concurrent claim took meanwhile read no further.
        lanes = {slots_of} if slots_of is not None else {s.queue for s in specs}
        for queue in sorted(lanes - report.weighed_lanes):
            own = [s for s in specs if s.queue == queue]
            more, _ = _rounds(ports, report, book, own, handed, (slots_of, slots), judged)
            read += more or 0
    return read


def _rounds(
    ports: Ports,
    report: PassReport,
    book: str,
    specs: list[StageSpec],
    handed: str | None,
    budget: tuple[str | None, int],
    judged: set[Pair],
) -> tuple[int | None, bool]:
    """Reads of the book's next pending pairs of `specs`, each dispatched, while the lanes take them all;
    (candidates read, whether the last read held every pending pair left), or (None, False) for an unknown book."""
    widest = candidate_limit([s.lane_limit for s in specs])
    # A refill of the slots a job freed or was handed claims that many pairs of its lane: reading for every slot of
    # a lane of 64 read 128 pairs (and wrote why 127 of them wait) to claim one, after every job.
    slots_of, slots = budget
    limit = candidate_limit([slots if s.queue == slots_of else s.lane_limit for s in specs])
    queues = ports.settings.registry.queues()
    lane_of = {s.name: s.queue for s in specs}
    read = 0
    for _ in range(MAX_ROUNDS):
        started, now = time.monotonic(), ports.clock()
        rows = ports.assets.gate_candidates(book, [s.name for s in specs], limit)
        if rows is None:
            return None, False
        if not rows.in_flight:
            return read, True
        fetched = len(rows.in_flight)
        read += fetched
        if judged:
            rows = replace(rows, in_flight=tuple(i for i in rows.in_flight if i.pair not in judged))
            if not rows.in_flight:
                return read, fetched < limit
        judged.update(i.pair for i in rows.in_flight)
        snap = ports.book_state.pair_snapshot(book, [i.pair for i in rows.in_flight], now, queues)
        authorized, _ = page.judge(snap, rows, report)
        result = dispatch.dispatch_pending(
            ports, book, authorized, snap, now=now, handed_lane=handed, slots_of=slots_of, slots=slots
        )
        report.outcomes.update(result.outcomes)
        report.dispatched.extend(result.dispatched)
        report.claimed_lanes |= result.claimed_lanes
        report.weighed_lanes |= result.weighed_lanes
        report.held_lanes |= result.held_lanes
        report.claimed_stages |= result.claimed_stages
        if result.dispatched:
            ports.counters.observe("gate_pass_seconds", time.monotonic() - started)
        # A denied candidate asks for the book's full pass now (it releases the pair), and so do a claim whose
        # publish failed (pending again, its slot free: it waited for reconcile) and a lane whose worker is
        # awaited (the tick's passes dispatch once it is back); a deferral written here (or a pair's wait for its
        # lane's open breaker to be tested: the book waits on the lane's list meanwhile) brings the next pass
        # forward. Never removed here: the pairs this read left out still wait.
        again = report.denied or result.outcomes.get(Outcome.PUBLISH_FAILED) or result.held_lanes
        due = ports.clock() if again else min(result.deferred_until.values(), default=None)
        if due is not None:
            page.write_due(ports, book, due, snap.due_at)
        if report.denied or fetched < limit:
            return read, fetched < limit
        if not result.claimed_lanes and limit < widest:
            # Not one of the few read came to a claim (each waits on a timer, or is done or running already):
            # the slot looks further, as far as a read for every slot would have.
            limit = widest
            continue
        # Pairs found done already left the pending ones as a claim's do: a read of nothing else claimed nothing and
        # ended the refill, its slot idle with work pending, the book on no waiting list and not due (soak hunt).
        if len(result.dispatched) + len(result.settled) < len(rows.in_flight):
            return read, False
        if slots_of is not None:
            taken = result.gone - result.settled
            slots -= sum(1 for i in rows.in_flight if i.pair in taken and lane_of[i.stage] == slots_of)
            if slots <= 0:  # the freed slots are filled: the lane's others are those of jobs ending elsewhere
                return read, False
    report.unread = True  # the lanes took all it read (claimed, or done already), and more is pending
    return read, False
