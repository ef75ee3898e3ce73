"""Dispatch: turn authorized `pending` pairs into GPU jobs, in the order the design fixes.

deferred? -> no consumer? -> breaker -> already completed / already generating ->
capacity (lane, book quota, scene window; counted under the lane lock) -> lease +
fencing token + `pending -> generating` + journal (one transaction) -> publish.

A deferred pair is skipped before any side effect: its only cost is its share of the
one deferral read the gate pass already made.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from animastor_tasks.adapters.ledger import Claim, InFlight, new_dispatch_id
from animastor_tasks.adapters.redis.coordination import Snapshot
from animastor_tasks.domain.gate import Pair
from animastor_tasks.domain.outcomes import Outcome, deferral_bucket, deferral_seconds, no_worker_reason
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import telemetry
from animastor_tasks.flow.runtime import Runtime

log = logging.getLogger("animastor.dispatch")


@dataclass
class DispatchResult:
    outcomes: Counter[str] = field(default_factory=Counter)
    dispatched: list[str] = field(default_factory=list)
    blocked: dict[str, list[str]] = field(default_factory=dict)


def dispatch_pending(
    rt: Runtime,
    book: str,
    pending: Sequence[InFlight],
    snap: Snapshot,
    *,
    now: float,
) -> DispatchResult:
    result = DispatchResult()
    deferred_pairs = set().union(*snap.deferred.values())
    todo: list[InFlight] = []
    for item in pending:
        if (item.chapter, item.scene, item.stage) in deferred_pairs:
            result.outcomes[Outcome.DEFERRED] += 1
        else:
            todo.append(item)
    if not todo:
        telemetry.record_outcomes(rt, result.outcomes)
        return result

    force = snap.force
    if now - snap.data_lost_at < rt.settings.force_ttl_seconds:
        # Redis lost its data (the force set with it) less than a force window ago: the commands in
        # Postgres still say which pairs were forced, so a forced pair is not settled as already completed.
        force = force | {pair for pair, _ in rt.ledger.forced_in_flight(book, rt.settings.force_ttl_seconds)}

    specs = {s: rt.settings.registry.get(s) for s in {i.stage for i in todo} if s in rt.settings.registry}
    todo = [i for i in todo if i.stage in specs]
    try:
        consumers = rt.consumers.counts([spec.queue for spec in specs.values()], snap.consumers)
    except StoreUnavailable as err:
        log.warning("[DISPATCH] book=%r presence registry unreadable, dispatching nothing: %s", book, err)
        return result
    except Exception as err:  # the AMQP broker refusing a passive declare
        log.warning("[DISPATCH] book=%r consumer count unavailable, dispatching nothing: %s", book, err)
        return result

    presence_unsure = now - snap.data_lost_at < rt.settings.presence_ttl_seconds
    unsure: set[str] = set()
    for stage, spec in specs.items():
        if consumers.get(spec.queue, 0) == 0:
            if presence_unsure:
                # Redis lost its data moments ago: workers have not re-advertised yet. Dispatch nothing
                # for the stage and block nothing; the next pass decides (no side effect here).
                unsure.add(stage)
                log.warning("[DISPATCH] book=%r stage=%s presence not rebuilt after a Redis loss; waiting", book, stage)
                continue
            result.blocked[stage] = block_stage(rt, book, spec)
            result.outcomes[Outcome.BLOCKED] += sum(1 for i in todo if i.stage == stage)
    todo = [i for i in todo if i.stage not in result.blocked and i.stage not in unsure]

    permits: dict[str, int] = {}
    open_stages: set[str] = set()
    for stage in {i.stage for i in todo}:
        if snap.breaker_clean.get(specs[stage].queue, False):
            continue  # no failure on record: closed, nothing to ask
        state = rt.coord.breaker_acquire(specs[stage].queue, rt.settings.breaker_cooldown_seconds)
        if state == "open":
            open_stages.add(stage)
            result.outcomes[Outcome.BREAKER_OPEN] += sum(1 for i in todo if i.stage == stage)
        elif state == "permit":
            permits[stage] = 1  # half-open: exactly one test dispatch
    todo = [i for i in todo if i.stage not in open_stages]

    todo = _settle_idempotent(rt, book, todo, force, result, now)
    if todo:
        _claim_and_publish(rt, book, todo, specs, permits, snap.breaker_clean, result, now)
    telemetry.record_outcomes(rt, result.outcomes)
    return result


def _settle_idempotent(
    rt: Runtime, book: str, todo: list[InFlight], force: set[Pair], result: DispatchResult, now: float
) -> list[InFlight]:
    """Already completed (same inputs, not forced) or already leased pairs are not dispatched."""
    done = [
        (i.chapter, i.scene, i.stage)
        for i in todo
        if (i.chapter, i.scene, i.stage) not in force and i.has_artifact and i.ready_hash == i.current_hash
    ]
    if done:
        completed = rt.ledger.mark_already_completed(book, done)
        _defer(rt, book, Outcome.ALREADY_COMPLETED, completed, now)
        result.outcomes[Outcome.ALREADY_COMPLETED] += len(completed)
    done_set = set(done)
    todo = [i for i in todo if (i.chapter, i.scene, i.stage) not in done_set]

    holders = rt.coord.lease_holders([(book, i.chapter, i.scene, i.stage) for i in todo])
    leased = [(i, holder) for i, holder in zip(todo, holders, strict=True) if holder is not None]
    if not leased:
        return todo
    busy: list[Pair] = []
    skip: set[Pair] = set()
    for i, holder in leased:
        pair = (i.chapter, i.scene, i.stage)
        if holder != i.dispatch_id:
            # A concurrent pass claimed the pair after this one read it: not ours to judge, no write.
            skip.add(pair)
        elif pair in force:
            # Force pre-clears the stale dispatch of exactly this pair (compare-and-delete on its id).
            rt.coord.release_lease((book, *pair), holder)
        else:
            busy.append(pair)
    _defer(rt, book, Outcome.ALREADY_GENERATING, busy, now)
    result.outcomes[Outcome.ALREADY_GENERATING] += len(busy)
    skip.update(busy)
    return [i for i in todo if (i.chapter, i.scene, i.stage) not in skip]


def _claim_and_publish(
    rt: Runtime,
    book: str,
    todo: list[InFlight],
    specs: dict[str, StageSpec],
    permits: dict[str, int],
    breaker_clean: dict[str, bool],
    result: DispatchResult,
    now: float,
) -> None:
    wanted = [((i.chapter, i.scene, i.stage), new_dispatch_id()) for i in todo]
    capacity: dict[Outcome, list[Pair]] = {}

    def choose(counts: dict[str, Any]) -> list[tuple[Pair, str]]:
        capacity.clear()
        lane = Counter({k: int(v) for k, v in counts["lane"].items()})
        quota: Counter[str] = Counter(stage for _, _, stage in counts["book_generating"])
        window_scenes = {(c, s) for c, s, _ in counts["book_generating"]}
        chosen: list[tuple[Pair, str]] = []
        for pair, dispatch_id in wanted:
            chapter, scene, stage = pair
            spec = specs[stage]
            outcome: Outcome | None = None
            if permits.get(stage, 1) <= 0:
                continue  # half-open breaker: the one test permit is spent; wait, do not defer
            if lane[stage] >= spec.lane_limit:
                outcome = Outcome.LANE_FULL
            elif quota[stage] >= spec.book_quota:
                outcome = Outcome.QUOTA_EXHAUSTED
            elif (chapter, scene) not in window_scenes and len(window_scenes) >= spec.window:
                outcome = Outcome.WINDOW_FULL
            if outcome is not None:
                capacity.setdefault(outcome, []).append(pair)
                continue
            chosen.append((pair, dispatch_id))
            lane[stage] += 1
            quota[stage] += 1
            window_scenes.add((chapter, scene))
            if stage in permits:
                permits[stage] -= 1
        return chosen

    def before_commit(claims: list[Claim]) -> None:
        for outcome, pairs in capacity.items():
            _defer(rt, book, outcome, pairs, now)
        rt.coord.take_leases(
            [
                (
                    (book, c.chapter, c.scene, c.stage),
                    c.dispatch_id,
                    specs[c.stage].lease_ttl,
                    {
                        "book": book,
                        "chapter": c.chapter,
                        "scene": c.scene,
                        "stage": c.stage,
                        "token": c.token,
                        "queue": specs[c.stage].queue,
                        "dispatched_at": now,
                    },
                )
                for c in claims
            ]
        )

    claims = rt.ledger.claim(book, wanted, {s: spec.queue for s, spec in specs.items()}, choose, before_commit)
    for outcome, pairs in capacity.items():
        result.outcomes[outcome] += len(pairs)
    if not claims:
        return
    publisher = rt.require_publisher()
    failed: list[Claim] = []
    for claim in claims:
        spec = specs[claim.stage]
        try:
            publisher.publish_job(spec.task_name, spec.queue, claim.dispatch_id, job_kwargs(book, claim))
        except Exception as err:
            failed.append(claim)
            log.error(
                "[DISPATCH] book=%r chapter=%r scene=%r stage=%s dispatch=%s publish failed: %s",
                book,
                claim.chapter,
                claim.scene,
                claim.stage,
                claim.dispatch_id,
                err,
            )
            rt.coord.breaker_record(
                spec.queue, False, rt.settings.breaker_threshold, rt.settings.breaker_cooldown_seconds
            )
            continue
        result.dispatched.append(claim.dispatch_id)
        result.outcomes[Outcome.DISPATCHED] += 1
        log.info(
            "[DISPATCH] book=%r chapter=%r scene=%r stage=%s dispatch=%s token=%d queue=%s",
            book,
            claim.chapter,
            claim.scene,
            claim.stage,
            claim.dispatch_id,
            claim.token,
            spec.queue,
        )
    # Bookkeeping after the jobs are on their way, so it never delays their start.
    rt.coord.clear_deferrals(book, [(c.chapter, c.scene, c.stage) for c in claims])
    for stage in {c.stage for c in claims if c not in failed}:
        if not breaker_clean.get(specs[stage].queue, False):
            rt.coord.breaker_record(
                specs[stage].queue, True, rt.settings.breaker_threshold, rt.settings.breaker_cooldown_seconds
            )
    if failed:
        rt.ledger.unclaim(book, failed)
        for claim in failed:
            rt.coord.release_lease((book, claim.chapter, claim.scene, claim.stage), claim.dispatch_id)
        result.outcomes[Outcome.PUBLISH_FAILED] += len(failed)


def job_kwargs(book: str, claim: Claim) -> dict[str, Any]:
    return {
        "book_id": book,
        "chapter_id": claim.chapter,
        "scene_id": claim.scene,
        "stage": claim.stage,
        "dispatch_id": claim.dispatch_id,
        "fencing_token": claim.token,
    }


def _defer(rt: Runtime, book: str, outcome: Outcome, pairs: Sequence[Pair], now: float) -> None:
    seconds = deferral_seconds(outcome, rt.windows)
    bucket = deferral_bucket(outcome)
    if pairs and seconds is not None and bucket is not None:
        rt.coord.defer(book, bucket, pairs, seconds, now)


def block_stage(rt: Runtime, book: str, spec: StageSpec) -> list[str]:
    """No live consumer: the stage's commands are BLOCKED and their pairs released; no retry."""
    reason = no_worker_reason(spec.name)
    blocked, released = rt.ledger.block_stage(book, spec.name, reason)
    rt.coord.drop_leases([(book, *pair) for pair, _ in released])
    rt.coord.clear_deferrals(book, [pair for pair, _ in released])
    dispatch_ids = [d for pair, d in released if d]
    if dispatch_ids and rt.publisher is not None:
        rt.publisher.revoke(dispatch_ids)
    telemetry.record_blocked(rt, spec.name, len(blocked))
    log.warning(
        "[DISPATCH] BLOCKED book=%r stage=%s queue=%s reason=%s commands=%s released=%d: no live consumer;"
        " start a worker (animastor-tasks worker --stage %s) and send a new regenerate",
        book,
        spec.name,
        spec.queue,
        reason,
        ",".join(blocked) or "none",
        len(released),
        spec.name,
    )
    return blocked
