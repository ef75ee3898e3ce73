"""One page of a gate pass: decide the pairs read, release the pending ones that lost their authority,
hand the authorized pending ones to dispatch, and say when the book's next pass is due.

A book's pass is one page (`gate.py`) unless the book has more pairs in flight than a pass holds at
once (`PAGE`); then it is a run of pages (`paged_pass.py`). Either way the rule is this one.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from animastor_tasks.domain.gate import BookFacts, Denial, decide_all
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import AssetState
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import dispatch
from animastor_tasks.ports import GateRows, Ports, Snapshot
from animastor_tasks.records import InFlight

log = logging.getLogger("animastor.gate")
PAGE = 10_000  # in-flight pairs a pass holds at once


@dataclass
class PassReport:
    """What a pass did. A paged pass counts what it authorized and denied but keeps no list of them."""

    book: str
    authorized: list[Pair] = field(default_factory=list)
    denied: dict[Pair, Denial] = field(default_factory=dict)
    released: list[Pair] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    dispatched: list[str] = field(default_factory=list)
    claimed_lanes: set[str] = field(default_factory=set)
    weighed_lanes: set[str] = field(default_factory=set)  # `DispatchResult.weighed_lanes`
    held_lanes: set[str] = field(default_factory=set)  # `DispatchResult.held_lanes`
    claimed_stages: set[str] = field(default_factory=set)  # stages a claim of a refill's took pairs of
    error: str | None = None
    authorized_count: int = 0
    unread: bool = False  # a refill's reads ran out, the lanes taking all they read: more is pending beyond


def pass_rows(
    ports: Ports,
    report: PassReport,
    snap: Snapshot,
    rows: GateRows,
    *,
    dispatch_work: bool,
    full_lanes: Collection[str],
    now: float,
    keep_pairs: bool = True,
) -> tuple[list[InFlight], dispatch.DispatchResult]:
    """Decide, release and dispatch the pairs of `rows` into `report`; the pending pairs still waiting and
    the dispatch's result (for `next_due`). A release is decided again under the book's lock on the facts of
    that moment (`Assets.release_denied`): those the pass read may have been overtaken since (a batch's read
    ahead, a paged pass's cursor, a Stop All and a new regenerate between a pass's read and its release)."""
    book = report.book
    authorized, denied = judge(snap, rows, report, keep_pairs=keep_pairs)
    pending = [i for i in authorized if i.state == AssetState.PENDING]
    released: list[Pair] = []
    if denied:  # most passes deny nothing: skip a walk of the page
        to_release = [i.pair for i in rows.in_flight if i.state == AssetState.PENDING and i.pair in denied]
        if to_release:
            asker = stop_stands(ports, book) if snap.cancel_flag else None
            released = ports.assets.release_denied(book, to_release, asker)
    if released:
        ports.deferrals.clear_deferrals(book, released)
        report.released.extend(released)
        log.info(
            "[COMMAND-GATE] book=%r released %d pending pair(s) to dirty: %s",
            book,
            len(released),
            _describe(denied, released),
        )
    result = dispatch.DispatchResult()
    if dispatch_work and pending:
        result = dispatch.dispatch_pending(ports, book, pending, snap, now=now, full_lanes=full_lanes)
        report.outcomes.update(result.outcomes)
        report.dispatched.extend(result.dispatched)
        report.claimed_lanes |= result.claimed_lanes
    return ([i for i in pending if i.pair not in result.gone] if result.gone else pending), result


def stop_stands(ports: Ports, book: str) -> Callable[[], bool]:
    """Asked under the book's lock where no tombstone stands, of a cancel flag the caller saw: whether it is a Stop
    All's own that no regenerate is lifting (`BookState.stop_stands`). Redis unreadable: no, nothing is released on
    it (the pairs stay denied, as every pass denies them while the flag stands)."""

    def ask() -> bool:
        try:
            return ports.book_state.stop_stands(book, ports.clock())
        except StoreUnavailable as err:
            log.warning("[COMMAND-GATE] book=%r cancel flag unreadable under the lock, nothing released on it: %s",
                        book, err)  # fmt: skip
            return False

    return ask


def pair_facts(ports: Ports, book: str, pairs: Sequence[Pair]) -> tuple[BookFacts, GateRows] | None:
    """The book's facts about these pairs, and their rows, read by key (a whole book's, a million pairs, cost a
    dead job's takeover 10 s and a gigabyte); None for a book that is gone. A store that cannot be read raises."""
    rows = ports.assets.gate_rows(book, pairs)
    if rows is None:
        return None
    flag = ports.book_state.cancel_flag_set(book)
    return BookFacts(True, flag, rows.tombstone, rows.layers_raw, rows.commanded), rows


def judge(
    snap: Snapshot, rows: GateRows, report: PassReport, *, keep_pairs: bool = True
) -> tuple[list[InFlight], dict[Pair, Denial]]:
    """The gate rule over the pairs read, counted into `report` (their pairs listed too, unless the pass
    is paged): the authorized pairs and why each other one is denied."""
    facts = BookFacts(True, snap.cancel_flag, rows.tombstone, rows.layers_raw, rows.commanded)
    authorized, denied = decide_all(facts, rows.in_flight)
    report.authorized_count += len(authorized)
    if keep_pairs:
        report.authorized.extend(i.pair for i in authorized)
        report.denied.update(denied)
    return authorized, denied


def next_due(snap: Snapshot, waiting: list[InFlight], written: dict[Pair, float], now: float) -> float | None:
    """When the first of the waiting pairs may go: the earliest deferral end (this pass's, its open breaker's test,
    or one read in the snapshot), now when one waits for no deferral (a Redis loss, a worker awaited, a pass that
    dispatched nothing), and never (None) while none waits."""
    if not waiting:
        return None
    pairs = {i.pair for i in waiting}  # one loop over a page's pairs; the rest are set operations
    ends = [end for pair, end in written.items() if pair in pairs]
    untouched = pairs.difference(written)
    if untouched.difference(*snap.deferred.values()):
        ends.append(now)
    elif untouched:
        ends.append(now if snap.first_deferral_end is None else snap.first_deferral_end)
    return min(ends)


def write_due(ports: Ports, book: str, due: float | None, due_at: float | None) -> None:
    """Keep the book's place in the due index. Written only when the book must come sooner than the index
    says (or leave it): an earlier entry costs one cheap pass, and a pass over deferred pairs stays free
    of writes. None: no pass until something happens (a job's end or a new command asks for one). Either write
    leaves alone an entry made sooner since `due_at` was read (a job that ended made the book due now): a stale
    pass put such a book back by up to a capacity deferral, or took it off the index. A write that fails raises:
    the caller's pass reports the error, and its book is due again (`gate_batch`). *Why:* logged only, the book was
    off the index (the tick took it) and waited for reconcile's round, several runs of 30 s at scale."""
    if due is None and due_at is not None:
        ports.book_state.clear_due(book, due_at)
    elif due is not None and (due_at is None or due < due_at):
        ports.book_state.set_due(book, due)


def lanes_without_room(ports: Ports) -> set[str]:
    """The queues whose lanes are full, counted without any lock: enough to refuse (a refusal never
    overfills a lane), never to claim (a claim counts again under the lane lock)."""
    registry = ports.settings.registry
    try:
        load = ports.assets.lane_load(registry.names())
    except StoreUnavailable as err:
        log.warning("[COMMAND-GATE] lane load unreadable, every pass counts its own: %s", err)
        return set()
    return {s.queue for s in registry.stages if load.get(s.name, 0) >= s.lane_limit}


def _describe(denied: dict[Pair, Denial], pairs: list[Pair]) -> str:
    shown = [f"{c}/{s}:{st}={denied.get((c, s, st), '?')}" for c, s, st in pairs[:5]]
    more = f" (+{len(pairs) - 5} more)" if len(pairs) > 5 else ""
    return ", ".join(shown) + more
