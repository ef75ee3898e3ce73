"""Dispatch: turn authorized `pending` pairs into GPU jobs, in the order the design fixes.

deferred? -> no consumer? -> breaker -> already completed / already generating -> capacity (lane, book quota,
scene window: counted under the lane and book locks, chosen by `domain.capacity`) -> lease + fencing token +
`pending -> generating` + journal (one transaction) -> publish.

A deferred pair is skipped before any side effect: its only cost is its share of the pass's one deferral read.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from animastor_tasks.domain import capacity
from animastor_tasks.domain.deferral import deferral_bucket, deferral_seconds, served_since, wait_score
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import DeferralBucket, Outcome
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import lanes, publish
from animastor_tasks.flow.leased import defer_while_leased
from animastor_tasks.ports import Claim, Ports, Snapshot
from animastor_tasks.records import InFlight

log = logging.getLogger("animastor.dispatch")


@dataclass
class DispatchResult:
    outcomes: Counter[str] = field(default_factory=Counter)
    dispatched: list[str] = field(default_factory=list)
    blocked: dict[str, list[str]] = field(default_factory=dict)
    claimed_lanes: set[str] = field(default_factory=set)  # queues whose capacity this pass counted (and handed on)
    weighed_lanes: set[str] = field(default_factory=set)  # of those, the lanes with a pair left to claim under the lock
    claimed_stages: set[str] = field(default_factory=set)  # stages of which this pass claimed a pair
    held_lanes: set[str] = field(default_factory=set)  # the handed lane, while its stage has no worker for now
    gone: set[Pair] = field(default_factory=set)  # pairs no longer pending: claimed, already completed, blocked
    settled: set[Pair] = field(default_factory=set)  # those already completed: no longer in flight either
    deferred_until: dict[Pair, float] = field(default_factory=dict)  # when each pair left waiting may go


def dispatch_pending(
    ports: Ports,
    book: str,
    pending: Sequence[InFlight],
    snap: Snapshot,
    *,
    now: float,
    handed_lane: str | None = None,
    full_lanes: Collection[str] = (),
    slots_of: str | None = None,
    slots: int = 1,
) -> DispatchResult:
    """`full_lanes`: queues seen without room (lock-free) by the caller; their pairs wait for a
    slot without a claim transaction (see `_wait_without_claim`). `slots_of`: the lane of the `slots` free
    slots this pass fills, which claims that many pairs of it at most (see `refill.free_slot`, `hand_over`)."""
    result = DispatchResult()
    deferred_pairs = _still_deferred(ports, snap, handed_lane)
    todo = [item for item in pending if item.pair not in deferred_pairs]
    if len(todo) < len(pending):
        result.outcomes[Outcome.DEFERRED] += len(pending) - len(todo)
    if not todo:
        count_outcomes(ports, result.outcomes)
        return result

    force = snap.force
    if now - snap.data_lost_at < ports.settings.force_ttl_seconds:
        # Redis lost the force set less than a force window ago: Postgres says which of these pairs were forced.
        forced = ports.commands.forced_in_flight(book, ports.settings.force_ttl_seconds, [i.pair for i in todo])
        force = force | {pair for pair, _ in forced}

    specs = {s: ports.settings.registry.get(s) for s in {i.stage for i in todo} if s in ports.settings.registry}
    unknown = {i.stage for i in todo} - specs.keys()
    if unknown:
        # A stage this process does not know (removed from ANIMASTOR_STAGES, or a worker configured without it):
        # its pairs wait, their commands active, but the book is not asked for again at once for them, every tick.
        log.warning("[DISPATCH] book=%r stages %s are not registered here; their pairs wait", book, sorted(unknown))
        result.gone.update(i.pair for i in todo if i.stage in unknown)
        todo = [i for i in todo if i.stage in specs]
    try:
        consumers = ports.presence.counts([spec.queue for spec in specs.values()], snap.consumers)
    except StoreUnavailable as err:  # the presence registry, or the AMQP broker refusing a passive declare
        log.warning("[DISPATCH] book=%r consumers unreadable, dispatching nothing: %s", book, err)
        _keep_handed(ports, book, handed_lane, todo, specs, result)
        return result

    presence_unsure = now - snap.presence_unsure_since < ports.settings.presence_ttl_seconds
    unconsumed = {stage: spec for stage, spec in specs.items() if consumers.get(spec.queue, 0) == 0}
    try:
        gone = set() if presence_unsure else lanes.gone_for_good(ports, [s.queue for s in unconsumed.values()])
    except StoreUnavailable as err:
        log.warning("[DISPATCH] book=%r presence registry unreadable, dispatching nothing: %s", book, err)
        _keep_handed(ports, book, handed_lane, todo, specs, result)
        return result
    unsure: set[str] = set()
    for stage, spec in unconsumed.items():
        if spec.queue not in gone:
            # Redis lost its data moments ago (workers have not re-advertised yet), the queue's last worker stopped
            # cleanly moments ago (a restart), or its heartbeat came back when counted again: nothing dispatched.
            unsure.add(stage)
            why = "a Redis loss" if presence_unsure else "its last one stopped moments ago, or it beat again"
            log.warning("[DISPATCH] book=%r stage=%s has no worker for now (%s); waiting", book, stage, why)
            if spec.queue == handed_lane:
                _keep_handed(ports, book, handed_lane, todo, specs, result)
            if not presence_unsure:  # its worker awaited: the pairs wait for its first heartbeat, on the lane's list
                until = lanes.await_worker(ports, book, spec.queue, min(i.rank for i in todo if i.stage == stage), now)
                result.deferred_until.update({i.pair: until for i in todo if i.stage == stage})
            continue
        result.blocked[stage] = lanes.block_lane(ports, spec, [book], exclude=book)[book]
        result.outcomes[Outcome.BLOCKED] += sum(1 for i in todo if i.stage == stage)
        result.gone.update(i.pair for i in todo if i.stage == stage)
    todo = [i for i in todo if i.stage not in result.blocked and i.stage not in unsure]

    permits: dict[str, int] = {}
    open_stages: set[str] = set()
    for stage in {i.stage for i in todo}:
        if snap.breaker_clean.get(specs[stage].queue, False):
            continue  # no failure on record: closed, nothing to ask
        state = ports.breaker.breaker_acquire(specs[stage].queue, ports.settings.breaker_cooldown_seconds)
        if state == "open":
            open_stages.add(stage)
            refused = [i for i in todo if i.stage == stage]
            result.outcomes[Outcome.BREAKER_OPEN] += len(refused)
            # Waiting for the breaker, the book waits for the lane too, at its most urgent pair's priority (its
            # place kept from pass to pass). *Why:* off the list, a reader's scene was invisible to the passes sent
            # as the breaker closed, and a bulk book passed first took every free slot. Its pairs wait until the
            # breaker may be tested (its closing hands the lane's slots to the books waiting): due now, the book
            # was passed again by every tick of an outage (the breaker reopens at each failed test), pairs all read.
            _wait_for_lane(ports, book, specs[stage].queue, min(i.rank for i in refused), now)
            until = ports.breaker.breaker_refuses_until(specs[stage].queue)
            result.deferred_until.update(dict.fromkeys((i.pair for i in refused), until))
        elif state == "permit":
            permits[stage] = 1  # half-open: exactly one test dispatch
    todo = [i for i in todo if i.stage not in open_stages]

    todo = _settle_idempotent(ports, book, todo, force, result, now)
    crowded = {s for s, spec in specs.items() if spec.queue in full_lanes and spec.queue != handed_lane}
    if crowded:
        _wait_without_claim(ports, book, [i for i in todo if i.stage in crowded], specs, result, now)
        todo = [i for i in todo if i.stage not in crowded]
    if todo:
        _claim_and_publish(ports, book, todo, specs, permits, snap, result, now, handed_lane, (slots_of, slots))
    for stage in permits.keys() - result.claimed_stages:
        # The test permit found nothing to test (done already, or no room): give it back for the next pass.
        ports.breaker.breaker_release(specs[stage].queue)
    count_outcomes(ports, result.outcomes)
    return result


def _still_deferred(ports: Ports, snap: Snapshot, handed_lane: str | None) -> set[Pair]:
    """The pairs this pass skips: deferred for a reason that still holds. Handed a free slot of a lane, its pairs
    waiting for capacity there may go now; once a lane's breaker holds no failure, the pairs kept from being its
    half-open test may run (and, failing, fail once like any other); deferrals stay until a claim clears them."""
    registry = ports.settings.registry

    def lane(pair: Pair) -> str | None:
        return registry.get(pair[2]).queue if pair[2] in registry else None

    kept: set[Pair] = set()
    for bucket, pairs in snap.deferred.items():
        if bucket == DeferralBucket.CAPACITY and handed_lane is not None:
            pairs = {p for p in pairs if lane(p) != handed_lane}
        elif bucket == DeferralBucket.BACKEND:
            pairs = {p for p in pairs if not snap.breaker_clean.get(lane(p) or "", False)}
        kept |= pairs
    return kept


def _settle_idempotent(
    ports: Ports, book: str, todo: list[InFlight], force: set[Pair], result: DispatchResult, now: float
) -> list[InFlight]:
    """Already completed (same inputs, not forced) or already leased pairs are not dispatched. Unknown inputs (no hash
    on record: a stage the scene's import did not know) prove nothing: such a pair runs."""
    done = [
        i.pair
        for i in todo
        if i.pair not in force and i.has_artifact and i.ready_hash is not None and i.ready_hash == i.current_hash
    ]
    if done:
        completed = ports.assets.mark_already_completed(book, done)
        _defer(ports, book, Outcome.ALREADY_COMPLETED, completed, now)
        result.outcomes[Outcome.ALREADY_COMPLETED] += len(completed)
        result.gone.update(completed)
        result.settled.update(completed)  # only what Postgres settled leaves: one it refused (its inputs changed
        todo = [i for i in todo if i.pair not in result.settled]  # since the read) is dispatched

    # Only a pair with a recorded dispatch can be held by it; one without is never read (a concurrent
    # claim of it is caught by the claim's compare-and-set on `pending`).
    recorded = [i for i in todo if i.dispatch_id is not None]
    holders = ports.leases.lease_holders([(book, i.chapter, i.scene, i.stage) for i in recorded])
    leased = [(i, holder) for i, holder in zip(recorded, holders, strict=True) if holder is not None]
    if not leased:
        return todo
    busy: list[Pair] = []
    for i, holder in leased:
        pair = i.pair
        if holder != i.dispatch_id:
            # Another dispatch's lease: a concurrent pass's claim (the claim's compare-and-set on `pending` and the
            # book's generating pairs, read under its lock, leave the pair to it), or one a claim that never
            # committed left behind, which this claim's lease replaces. Skipped, such a pair waited out the stray
            # lease's queued day, its book passed on every tick.
            continue
        if pair in force:
            # Force pre-clears the stale dispatch of exactly this pair (compare-and-delete on its id).
            ports.leases.release_lease((book, *pair), holder)
        else:
            busy.append(pair)
    result.deferred_until.update(defer_while_leased(ports, book, busy, now))
    result.outcomes[Outcome.ALREADY_GENERATING] += len(busy)
    skip = set(busy)
    return [i for i in todo if i.pair not in skip]


def _claim_and_publish(
    ports: Ports,
    book: str,
    todo: list[InFlight],
    specs: dict[str, StageSpec],
    permits: dict[str, int],
    snap: Snapshot,
    result: DispatchResult,
    now: float,
    handed_lane: str | None,
    budget: tuple[str | None, int],
) -> None:
    todo = sorted(todo, key=slot_order)
    slots_of, slots = budget
    room = {s: slots for s, spec in specs.items() if spec.queue == slots_of}
    wanted = [(i.pair, uuid.uuid4().hex) for i in todo]  # 128 random bits: never guessable nor reused
    queue_of = {stage: spec.queue for stage, spec in specs.items()}
    # The fair share binds only while another book waits for the lane (the head of its waiting list).
    waiters = {
        stage: {b: rank for b, rank in snap.waiters.get(queue, {}).items() if b != book}
        for stage, queue in queue_of.items()
    }
    # Books handed a slot moments ago, their refills on their way (off the list meanwhile): a more urgent one's slot is
    # not this pass's. *Why:* a bulk pass took an interactive book's, and the reader's scene waited a bulk job more.
    handed = {
        stage: {b: rank for b, rank in snap.handed.get(queue, {}).items() if b != book and b not in waiters[stage]}
        for stage, queue in queue_of.items()
    }
    # The books of a pair's priority before this one: listed earlier, or handed a slot. None on the lane handed to it:
    # the list's order gave it the slot. *Why:* a book whose regenerate came as a slot freed took it from the book that
    # had waited for the lane longest (its job's refill not yet claimed), as only more urgent books kept their slots.
    ahead = {
        stage: set()
        if queue == handed_lane
        else capacity.waited_longer(snap.places.get(queue, {}), snap.waiters.get(queue, {}), book, now)
        | set(handed[stage])
        for stage, queue in queue_of.items()
    }
    claims: list[Claim] = []
    room_of = {stage for stage, queue in queue_of.items() if queue == handed_lane}  # the handed lane's stage
    noted: tuple[str, int] | None = None  # the lane whose record the claim's batch took away, the rank it held
    try:
        with ports.assets.claiming(book, queue_of, waiters, handed, ahead) as session:
            # A pair a concurrent pass of the book claimed since this one read it would take a slot of the choice
            # and then fail the claim's compare-and-set: under the book lock its own generating pairs say which.
            taken_meanwhile = set(session.counts.book_generating)
            unclaimed = [w for w in wanted if w[0] not in taken_meanwhile] if taken_meanwhile else wanted
            ranks = {i.pair: i.rank for i in todo}
            choice = capacity.choose(unclaimed, session.counts, specs, permits, room, ranks)
            claims = session.claim(choice.chosen)
            if choice.chosen and not claims:
                # Each pair chosen left pending since the read (a concurrent pass found it done already): chosen again
                # without them. *Why:* such a pair took the claim's one slot, and the slot idled with work pending.
                gone = {pair for pair, _ in choice.chosen}
                unclaimed = [w for w in unclaimed if w[0] not in gone]
                choice = capacity.choose(unclaimed, session.counts, specs, permits, room, ranks)
                claims = session.claim(choice.chosen)
            taken = Counter(c.stage for c in claims)
            # Still under the lane and book locks: a completion takes them before it frees capacity,
            # so these deferrals can never land after the completion that should clear them, and a
            # claimed pair is never without its lease for reconcile to see. One Redis round trip.
            with ports.leases.batched():
                for outcome, pairs in choice.refused.items():
                    _defer(ports, book, outcome, pairs, now, result)
                lane_full = {stage for _, _, stage in choice.refused.get(Outcome.LANE_FULL, ())}
                for stage in choice.waits_for:  # one stage per lane (the registry refuses a queue shared)
                    # The pairs that wait for the lane say the priority it waits at; one its cap refused does not
                    # wait (an interactive pair at the cap put the book's bulk ones ahead of the normal waiters).
                    rank = min(i.rank for i in todo if i.pair in choice.waiting and i.stage == stage)
                    if taken[stage]:
                        # Given a slot of the lane by this pass: to the back of the most urgent priority it still has
                        # waiting there (round robin: `served_since`), not the place an urgent pair it now runs gave it.
                        _wait_for_lane(ports, book, queue_of[stage], rank, served_since(now), served=True)
                        continue
                    # Handed a slot that another pass took first: back to the head of its priority, not the end.
                    # Refused by its own share, or by a more urgent book's hold on a slot the lane still has (a slot
                    # handed twice), it waits behind the books that waited longer. *Why the last:* at the head, it
                    # was the next one handed the slot it could not take, and two such books bounced it between them.
                    taken_by_another = specs[stage].lane_limit <= session.counts.lane.get(stage, 0)
                    first = queue_of[stage] == handed_lane and stage in lane_full and taken_by_another
                    _wait_for_lane(ports, book, queue_of[stage], rank, 0.0 if first else now)
                ports.leases.take_leases([publish.claim_lease(book, c, specs[c.stage], now) for c in claims])
                ports.deferrals.clear_deferrals(book, [c.pair for c in claims])  # they wait no longer
                if handed_lane is not None and (mine := [ranks[c.pair] for c in claims if c.stage in room_of]):
                    # The handed slot is claimed: its record goes before the COMMIT that counts the claim. *Why:* it
                    # went once the refill had published, and counts of the lane meanwhile (`lanes.hand_on_freed`, a
                    # pass's spare slots) subtracted the slot twice: a free one idled until the tick's stranded check.
                    ports.deferrals.hand_over_done(handed_lane, book, now + lanes.HANDED_CLOCK_SLACK)
                    noted = (handed_lane, snap.handed.get(handed_lane, {}).get(book, min(mine)))
            spare = {
                spec.queue: spec.lane_limit - session.counts.lane.get(s, 0) - taken[s] for s, spec in specs.items()
            }
    except Exception:
        # The claim did not commit (Postgres refused the COMMIT, or the lease write failed after Redis took it): a
        # lease written for it would hold its pair a queued lease's whole TTL, every pass skipping it as claimed.
        publish.drop_leases(ports, book, claims)
        if noted is not None:
            lanes.hand_over_again(ports, book, noted[0], now, noted[1])
        raise
    result.claimed_lanes.update(queue_of.values())
    result.weighed_lanes.update(queue_of[stage] for (_, _, stage), _ in unclaimed)
    result.claimed_stages.update(c.stage for c in claims)
    result.gone.update(c.pair for c in claims)
    for outcome, pairs in choice.refused.items():
        result.outcomes[outcome] += len(pairs)
    if claims:
        published, failed = publish.publish_claims(ports, book, claims, specs, snap.breaker_clean)
        result.dispatched += published
        result.outcomes[Outcome.DISPATCHED] += len(published)
        if failed:  # pending again: they wait, and the book stays due for them
            result.gone.difference_update(c.pair for c in failed)
            result.outcomes[Outcome.PUBLISH_FAILED] += len(failed)
    holding = {queue_of[s] for s, books in handed.items() if books}
    for queue, free in spare.items():
        # Slots this book cannot use (its cap, nothing more pending) go to the books waiting for the lane at once:
        # a free slot never waits for a deferral to expire. The snapshot read the head of each waiting list already:
        # an empty one costs no second read, but of the lane handed (its own book's refill took its pair: that read
        # is old). Of a lane whose freed slots this pass fills, only those are handed on (when unused).
        known = snap.waiters.get(queue)
        if free > 0 and (known is None or queue == handed_lane or any(b != book for b in known)):
            most = (
                slots - sum(taken[s] for s, spec in specs.items() if spec.queue == queue) if queue == slots_of else free
            )
            try:
                lanes.hand_on_spare(ports, book, queue, free, most=most, held=queue in holding or queue == handed_lane)
            except StoreUnavailable as err:  # claimed and published: the tick hands on a lane's stranded slots
                log.warning("[DISPATCH] book=%r free slots of %s not handed on: %s", book, queue, err)


def slot_order(item: InFlight) -> tuple[int, float, int]:
    """The order pairs get slots in: the most urgent priority first, then the oldest command, then reading order."""
    return item.rank, item.since if item.since is not None else float("inf"), item.position


def _wait_without_claim(
    ports: Ports, book: str, items: list[InFlight], specs: dict[str, StageSpec], result: DispatchResult, now: float
) -> None:
    """Pairs of lanes the caller saw full wait (`lane_full`, the book on the lanes' lists) with no claim transaction
    and no lock: a refusal never overfills a lane. The caller counts the lanes again once its books are listed."""
    if not items:
        return
    _defer(ports, book, Outcome.LANE_FULL, [i.pair for i in items], now, result)
    result.outcomes[Outcome.LANE_FULL] += len(items)
    for stage in {i.stage for i in items}:
        _wait_for_lane(ports, book, specs[stage].queue, min(i.rank for i in items if i.stage == stage), now)


def _keep_handed(
    ports: Ports, book: str, lane: str | None, todo: list[InFlight], specs: dict[str, StageSpec], result: DispatchResult
) -> None:
    """Handed a slot it cannot use for now (its stage's worker awaited, presence unreadable): the book keeps the
    slot rather than pass it down the list (each next book found the same and dropped off it, the list empty by
    the time the worker or the store was back, the slots idle until the books' deferrals ran out). Its pairs wait
    for the tick's passes (the caller makes the book due now), capacity deferrals cleared, the book at the head."""
    items = [i for i in todo if i.stage in specs and specs[i.stage].queue == lane]
    if lane is None or not items:
        return
    ports.deferrals.wait_for_lane(lane, book, wait_score(min(i.rank for i in items), 0.0))
    ports.deferrals.clear_deferrals(book, [i.pair for i in items])
    result.held_lanes.add(lane)


def _wait_for_lane(ports: Ports, book: str, queue: str, rank: int, since: float, *, served: bool = False) -> None:
    """The book joins the lane's waiting list at `rank`, the most urgent priority its refused pairs have."""
    lasts = ports.settings.job_time_limit  # a place it was served with stands while its job may run
    ports.deferrals.wait_for_lane(queue, book, wait_score(rank, since), served=served, job_lasts=lasts)


def _defer(
    ports: Ports, book: str, outcome: Outcome, pairs: Sequence[Pair], now: float, result: DispatchResult | None = None
) -> None:
    seconds = deferral_seconds(outcome, ports.settings.deferral_windows)
    bucket = deferral_bucket(outcome)
    if pairs and seconds is not None and bucket is not None:
        ports.deferrals.defer(book, bucket, pairs, seconds, now)
        if result is not None:
            result.deferred_until.update(dict.fromkeys(pairs, now + seconds))


def count_outcomes(ports: Ports, outcomes: Mapping[str, int]) -> None:
    """A deferred pair must cost no write: deferrals are not counted (the exporter reads the deferral sets)."""
    ports.counters.add({f"dispatch:{o}": n for o, n in outcomes.items() if o != Outcome.DEFERRED})
