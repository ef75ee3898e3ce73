"""Lanes: who gets a lane's free slots, and what becomes of a lane that lost every consumer.

Apart from dispatch (flow/dispatch.py) because every flow that frees slots (a job's end, a
cancel, the takeover of a dead worker's, the tick) hands them on through here.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from animastor_tasks.domain import capacity, lost_passes
from animastor_tasks.domain.deferral import wait_score
from animastor_tasks.domain.registry import CONTROL_QUEUE, StageSpec
from animastor_tasks.domain.vocabulary import no_worker_reason
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.ports import Ports

log = logging.getLogger("animastor.dispatch")
BATCH_BOOKS = 50  # books per gate task sent for the due index
HEARTBEAT_SLACK = 0.5  # seconds past a heartbeat period before a second count of a queue's consumers
LOST_HAND_OVER_TICKS = 2  # a handed book's refill not back within this many ticks was lost (lua/handed_restore.lua)
# A hand-over record written up to this long after a refill began is the refill's own: the hand-over and the
# refill read the Redis clock in two processes, each carried by its own monotonic clock (they agree to within
# milliseconds). A record written later is a second hand-over, whose refill has yet to report back.
HANDED_CLOCK_SLACK = 1.0


def successor_awaited(ports: Ports, queues: Sequence[str]) -> dict[str, float]:
    """Those of `queues` (none of them consumed) whose last worker stopped cleanly less than
    `silent_worker_seconds` ago, with the seconds their successor has left before the stage's commands are BLOCKED: a
    restart, whose successor is given that long to consume; or longer ago (at most a job's hard time limit more)
    while another worker still drains its jobs (it holds its queues, `Presence.held`): a rollout whose successors
    start once it is done. *Why:* a deployment that replaces a stage's only worker (`docker compose up`) leaves its
    queue without a consumer for the seconds the new one takes to start, and the tick BLOCKED every command with work
    in flight there, for good; and compose starts a host's new containers only once all its old ones have stopped, so
    an idle worker's stage was BLOCKED 30 s into its neighbour's drain of a long job. A StoreUnavailable is the
    caller's."""
    if not queues:
        return {}
    grace = ports.settings.silent_worker_seconds
    everyone = sorted({spec.queue for spec in ports.settings.registry.stages} | set(queues))
    departed = ports.presence.departed_ago(everyone)  # one read: these queues' stops and every other one's
    mine = {queue: departed[queue] for queue in queues if queue in departed}
    awaited = {queue: grace - ago for queue, ago in mine.items() if ago < grace}
    longest = grace + ports.settings.job_time_limit
    longer = {queue: longest - ago for queue, ago in mine.items() if grace <= ago < longest}
    # A rollout under way: a worker stopped cleanly less than `grace` ago (a drain just ended: a compose project's
    # successors start once its last old container has stopped), or one drains its jobs still (it holds its queues).
    if longer and (any(ago < grace for ago in departed.values()) or ports.presence.held(everyone)):
        awaited |= longer
    return awaited


def gone_for_good(ports: Ports, queues: Sequence[str]) -> set[str]:
    """Those of `queues` (none consumed at the caller's count) whose stages are to be BLOCKED: not a restart awaiting
    its successor (`successor_awaited`), and still without a consumer when counted again one heartbeat later.
    *Why:* heartbeats lapse while Redis cannot be reached, and come back within a heartbeat of it; a control process
    that had sent Redis nothing meanwhile (idle, or its broker down too) knew of no outage, read "no consumer" in
    between and BLOCKED every stage with work in flight, for good. A StoreUnavailable is the caller's.

    A queue a double count (by any process) found so within a presence TTL needs no wait more, only a count now:
    no heartbeat can have come and lapsed since. That count, a heartbeat or more after the note, notes it again.
    *Why:* each pass of a book with work on a stage that lost its only worker slept the heartbeat (2.5 s), one book
    after another: 100 due books held both control processes for two minutes, a regenerate of a healthy stage
    queued behind them."""
    restarting = successor_awaited(ports, queues)
    silent = [queue for queue in queues if queue not in restarting]
    if not silent:
        return set()
    # A heartbeat still live is a worker killed moments ago (on AMQP the broker's zero came at once, as its connection
    # closed): gone once that beat lapses, within a TTL. *Why:* a restart's first beat (systemd, a container's restart
    # policy) came after the broker's zero and its second count, and the stage's commands were BLOCKED for good.
    beating = {queue for queue, live in ports.presence.live_consumers(silent).items() if live}
    silent = [queue for queue in silent if queue not in beating]
    if not silent:
        return set()
    now, ttl = ports.clock(), ports.settings.presence_ttl_seconds
    heartbeat = ttl / 3 + HEARTBEAT_SLACK  # a live worker beats every TTL/3
    seen = {queue: when for queue, when in ports.presence.unconsumed_seen(silent).items() if now - when <= ttl}
    # Counted again now: the caller's count may be seconds old (a batch reads its books' snapshots ahead).
    counted = ports.presence.counts(sorted(seen)) if seen else {}
    gone = {queue for queue in seen if counted.get(queue, 0) == 0}
    noted = {queue for queue in gone if now - seen[queue] >= heartbeat}
    unknown = [queue for queue in silent if queue not in seen]
    if unknown:
        time.sleep(heartbeat)
        again = ports.presence.counts(unknown)
        noted |= {queue for queue in unknown if again.get(queue, 0) == 0}
        gone |= noted
    if noted:
        ports.presence.note_unconsumed(sorted(noted))
    return gone


def await_worker(ports: Ports, book: str, queue: str, rank: int, now: float) -> float:
    """The book's pairs of `queue`, whose worker is awaited (`gone_for_good` found it not gone), wait on the lane's
    list at `rank` for the worker's first heartbeat (`consumers_arrived`); returns when the book is due again, to
    block the stage if none came. *Why:* due now, every such book was passed again at every tick, all its pairs
    read, for as long as the worker was awaited (30 s; a rollout's drain, up to a job's time limit more). On the
    list before the note: a first beat between the two found a list without the book, whose pairs waited 30 s."""
    ports.deferrals.wait_for_lane(queue, book, wait_score(rank, now), job_lasts=ports.settings.job_time_limit)
    ports.presence.await_consumer([queue])
    return now + ports.settings.silent_worker_seconds


def consumers_arrived(ports: Ports, queues: Collection[str]) -> None:
    """A worker consumes `queues` that passes awaited a worker on: their free slots go to the books waiting."""
    log.info("[DISPATCH] a worker consumes %s again: their free slots go to the books waiting", sorted(queues))
    hand_on_freed(ports, set(queues))


def block_lane(
    ports: Ports, spec: StageSpec, books: Sequence[str], *, exclude: str | None = None
) -> dict[str, list[str]]:
    """No live consumer: the stage is BLOCKED for `books` (their blocked command ids), then the lane goes to
    the books waiting for it (not `exclude`): their capacity deferrals would keep their own passes from the
    consumer check for a whole window, and handed passes look past them and BLOCK them too, now."""
    blocked = {book: block_stage(ports, book, spec) for book in books}
    hand_over(ports, spec.queue, spec.lane_limit, exclude=exclude)
    return blocked


def block_stage(ports: Ports, book: str, spec: StageSpec) -> list[str]:
    """No live consumer: the stage's commands are BLOCKED and their pairs released, and the book leaves the lane's
    waiting list (joined while the worker was awaited, it held its place with nothing to run); no retry."""
    reason = no_worker_reason(spec.name)
    blocked, released = ports.commands.block_stage(book, spec.name, reason)
    ports.deferrals.leave_lanes(book, [spec.queue])
    ports.leases.release_leases([((book, *pair), d) for pair, d in released if d])
    ports.deferrals.clear_deferrals(book, [pair for pair, _ in released])
    dispatch_ids = [d for _, d in released if d]
    if dispatch_ids:
        ports.publisher.revoke(dispatch_ids)
    if not blocked and not released:
        # Blocked a moment before (the tick passed the book again): the operator was told then, and nothing changed.
        log.info("[DISPATCH] book=%r stage=%s: no live consumer, and nothing of it left to block", book, spec.name)
        return blocked
    ports.counters.add({f"blocked:{spec.name}": len(blocked)})
    log.warning(
        "[DISPATCH] BLOCKED book=%r stage=%s queue=%s reason=%s commands=%s released=%d: no live consumer;"
        " start a worker (animastor-tasks worker --stage %s) and send a new regenerate",
        book, spec.name, spec.queue, reason, ",".join(blocked) or "none", len(released), spec.name,
    )  # fmt: skip
    return blocked


def hand_over(ports: Ports, queue: str, slots: int, *, exclude: str | None = None) -> list[str]:
    """Free slots of a lane go to the books that have waited longest for it, each with a refill
    told which lane it is handed (it looks past its capacity deferrals on the lane); a book served this
    way waits at the back again when the lane is full (round robin). Returns the books served. Nothing of
    the served books is written here. Several slots go to the books of the head's priority alone, which share
    them (`capacity.share_slots`), each claiming its share at most, and the last refill of them hands on what is
    still free (`refill.refill`); a book with no use for its slots hands them on, to less urgent books once none
    as urgent waits. *Why:* each took every free slot it could (the others were off the list, so its fair share
    did not bind), and the books after the first waited a job for theirs; and one slot to each book from the
    head, a bulk book's refill run first took a slot a reader's next interactive scene waited for. Slots a book
    (`exclude`) hands on that the list leaves go to books handed a slot moments ago whose refills have not reported
    back (off the list meanwhile: a slot handed on went to nobody beside such a book with more pairs to run)."""
    if slots <= 0:
        return []
    books = ports.deferrals.next_waiters(queue, slots, exclude=exclude)
    batch = ports.deferrals.open_hand_over(len(books)) if len(books) > 1 else None
    for waiter, share in zip(books, capacity.share_slots(slots, len(books)), strict=True):
        ports.publisher.enqueue_refill(waiter, lane=queue, slots=share if batch else None, batch=batch)
    return books


def send_due_passes(ports: Ports, *also: str) -> list[str]:
    """The gate passes of the books due now (the due index), several per task, and of `also`. The books of a batch
    the broker refuses, and of those after it, are due again. *Why:* taken off the index first, they waited for
    reconcile's round to reach them (30 s, or several rounds), pairs the same tick had taken over among them."""
    now = ports.clock()
    taken = ports.book_state.take_due(now)  # with the passes lost with their holder's process (flow/pass_hold.py)
    lapsed, lapses = taken.lapsed, taken.lapses
    plan = lost_passes.sort_passes([*taken.due, *also], lapsed, lapses)
    if plan.given_up:
        _give_up(ports, plan.given_up, lapses)
    resent = [b for b in lapsed if b not in plan.given_up]
    if resent:
        log.warning("[DISPATCH] passes of %d book(s) lost with their holder's process: sent again", len(resent))
        ports.counters.add({"lost_pass": len(resent)})
    books = [*plan.alone, *plan.batched]
    batches = [[b] for b in plan.alone]
    batches += [plan.batched[first : first + BATCH_BOOKS] for first in range(0, len(plan.batched), BATCH_BOOKS)]
    for sent, batch in enumerate(batches):
        try:
            ports.publisher.enqueue_gates(batch)
        except Exception:
            due_again(ports, [b for unsent in batches[sent:] for b in unsent], now)
            raise
    return books


def _give_up(ports: Ports, books: Sequence[str], lapses: Mapping[str, int]) -> None:
    """Books whose passes were lost with their process too many times in a row: sent again only when something
    else makes them due (reconcile's round, a regenerate), then alone."""
    log.error(
        "[DISPATCH] %s: pass lost with its control process that many times in a row (does it kill it?); sent again"
        " only when something else makes it due, alone",
        ", ".join(f"book={b!r} {lapses[b]} times" for b in books),
    )
    ports.counters.add({"lost_pass_given_up": len(books)})


def due_again(ports: Ports, books: Sequence[str], when: float) -> None:
    """`books`, taken off the due index for passes that did not happen, are due again by `when`."""
    try:
        ports.book_state.set_due_all(books, when)
    except StoreUnavailable as err:  # Redis too: reconcile's round finds them
        log.warning("[DISPATCH] %d due book(s) not put back on the due index: %s", len(books), err)


def breaker_closed(ports: Ports, queue: str, *also: str, hand_on: bool = True) -> None:
    """A success closed the lane's open breaker: its free slots go to the books waiting for it, most urgent first
    (those whose pairs waited for the breaker among them), and the books due now get their passes at once. *Why:*
    the job or test publish that closed it used one slot, and the lane's other free slots stood idle until the next
    tick (up to 5 s), or two ticks for the books waiting with capacity deferrals (a due pass looks past those).
    `hand_on` False: the caller, a pass, hands the lane's free slots on itself (twice, each went to two books)."""
    if hand_on:
        try:
            hand_on_freed(ports, {queue})
        except Exception as err:  # Redis or the broker: the stranded check hands them on; the caller goes on
            log.warning("[DISPATCH] breaker of %s closed; its free slots not handed on: %s", queue, err)
    try:
        books = send_due_passes(ports, *also)
    except Exception as err:  # Redis or the broker: the next tick sends them; the caller's job or pass goes on
        log.warning("[DISPATCH] breaker of %s closed; passes of the books due not sent: %s", queue, err)
        return
    log.info("[DISPATCH] breaker of %s closed: passes of %d due book(s) sent", queue, len(books))


def hand_on_stranded(ports: Ports) -> list[str]:
    """Free slots of the lanes whose books have waited for them since the previous tick go to those books; returns
    those lanes. *Why:* a slot whose refill was lost (the process that freed it died after its commit, a control
    worker was killed running the refill) stood free beside its waiting books until reconcile's count of the lanes
    (30 s). Seen once, a free slot is left to the refill on its way; seen again a tick later, it has none, unless
    it was handed moments ago (`handed_slots`): the two sightings need not be of one slot, and a slot handed through
    the control queue to a reader's book was handed again, to a normal book whose refill ran first."""
    try:
        _restore_lost_hand_overs(ports)
        free = _free_slots(ports)
        stranded = ports.deferrals.stranded_lanes(sorted(free), ports.settings.tick_seconds / 2)
        held = handed_slots(ports, stranded) if stranded else {}
    except StoreUnavailable as err:  # reconcile counts the lanes too
        log.warning("[DISPATCH] lanes not counted for stranded slots this tick: %s", err)
        return []
    free = {queue: free[queue] - held.get(queue, 0) for queue in stranded}
    stranded = [queue for queue in stranded if free[queue] > 0]
    for queue in stranded:
        try:
            books = hand_over(ports, queue, free[queue])
        except Exception as err:  # Redis or the broker: the tick's due passes still go; reconcile counts again
            log.warning("[DISPATCH] free slots of %s not handed on: %s", queue, err)
            continue
        if books:  # none while the lane's breaker is open: its books wait for the breaker, not for a lost refill
            log.warning(
                "[DISPATCH] %d free slot(s) of %s stood beside waiting books since the last tick; handed to %d",
                free[queue],
                queue,
                len(books),
            )
    return stranded


def _restore_lost_hand_overs(ports: Ports) -> None:
    """Books handed a slot whose refills never reported back within two ticks go back on the waiting lists at
    their places (their slots are then stranded ones, handed on the tick after). *Why:* a hand-over takes its books
    off the list; its refill lost (a control worker killed running it), nothing was left on the list to see the
    slot stranded, and the book's pairs waited out their capacity deferral (a minute) beside the free slot."""
    stage_of = {s.queue: s.name for s in ports.settings.registry.stages}
    min_age = LOST_HAND_OVER_TICKS * ports.settings.tick_seconds
    restored = ports.deferrals.restore_lost_hand_overs(sorted(stage_of), min_age)
    if not restored:
        return
    # A refill still queued behind a burst of control messages is late, not lost: nothing died. *Why:* counted lost,
    # 3,000 regenerates sent at once raised `animastor_lost_refills_total`, which says control workers die mid-task.
    backlog = ports.queue_probe.waiting(CONTROL_QUEUE)
    why = f"is not back after two ticks, {backlog} control message(s) waiting" if backlog else "never reported back"
    for queue, book in restored:
        log.warning("[DISPATCH] book=%r was handed a slot of %s and its refill %s: waits again", book, queue, why)
    kind = "late_refill" if backlog else "lost_refill"  # animastor_late_refills_total, animastor_lost_refills_total
    ports.counters.add(Counter(f"{kind}:{stage_of[queue]}" for queue, _ in restored))


def hand_on_freed(ports: Ports, full: set[str]) -> None:
    """Count these lanes (seen full, or every lane in reconcile) again, now that the books have joined their
    waiting lists: a slot freed meanwhile (its job's end may have looked at a list before they joined) is handed
    on now. A slot handed moments ago is not (`handed_slots`): read after the count, a record's refill that claims
    in between is counted free at worst (its record goes before its claim's COMMIT), and its slot handed twice."""
    try:
        free = _free_slots(ports, full)
        held = handed_slots(ports, free) if free else {}
    except StoreUnavailable as err:  # the passes are done: a slot freed meanwhile waits for the next job's end
        log.warning("[COMMAND-GATE] lanes %s not counted again: %s", sorted(full), err)
        return
    for queue, slots in free.items():
        hand_over(ports, queue, slots - held.get(queue, 0))


def handed_slots(ports: Ports, queues: Collection[str], *, exclude: str | None = None) -> dict[str, int]:
    """Per lane, the slots handed less than `capacity.HANDED_HOLD_SECONDS` ago to books (not `exclude`) whose refills
    have not claimed them (off the waiting list still; a claim takes its refill's record away): each such refill
    claims its slot, which a count of the lanes sees as free. *Why:* handed again, it went to a less urgent book
    whose refill the hold refused, and that book handed it on in turn: refills bounced it between books hundreds of
    times a second. Past the hold a lost refill's slot counts as free again, as before. Read with the lanes' part of
    a snapshot (of no book: one round trip)."""
    snap = ports.book_state.pair_snapshot("", (), ports.clock(), sorted(queues))
    return {
        q: sum(1 for b in books if b != exclude and b not in snap.waiters.get(q, {}))
        for q, books in snap.handed.items()
    }


def hand_on_spare(ports: Ports, book: str, queue: str, free: int, *, most: int, held: bool) -> None:
    """`free` slots of `queue` that a pass of `book` counted under the lane lock and left unused, `most` of them at
    most, go to the books waiting for the lane. `held`: the pass's snapshot saw slots handed moments ago, their
    refills' to claim, not spare: their records are read again, since one the snapshot read may be of a refill whose
    claim the pass's count includes (a claim takes its record away, `dispatch`)."""
    if held:
        free -= handed_slots(ports, [queue], exclude=book).get(queue, 0)
    hand_over(ports, queue, min(free, most), exclude=book)


def hand_over_again(ports: Ports, book: str, queue: str, at: float, rank: int) -> None:
    """A handed claim whose batch took its hand-over record away did not commit: the record again, at the head of
    `rank` (the priority it was handed the slot at), so that its refill keeps the book's place there
    (`refill._keep_place`) and a refill lost puts it back on the list. Best effort: lost, the refill keeps the place
    the book holds on the list, if any (`lua/handed_keep.lua`), and the book is due at once."""
    try:
        ports.deferrals.hand_over_again(queue, book, at, wait_score(rank, 0.0))
    except StoreUnavailable as err:
        log.warning("[DISPATCH] book=%r hand-over record of %s not written again: %s", book, queue, err)


def _free_slots(ports: Ports, queues: Collection[str] | None = None) -> dict[str, int]:
    """The free slots of each lane (of `queues`, or every one) that has any, counted without a lock
    (`Assets.lane_load`): enough to hand slots on (a refill claims under the lane lock), never to claim."""
    stages = [s for s in ports.settings.registry.stages if queues is None or s.queue in queues]
    load = ports.assets.lane_load([s.name for s in stages])
    return {s.queue: s.lane_limit - load.get(s.name, 0) for s in stages if load.get(s.name, 0) < s.lane_limit}
