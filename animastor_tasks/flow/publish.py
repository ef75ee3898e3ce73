"""The end of a dispatch: each claimed pair's job published to its stage's queue, under its lease.

A publish the broker refuses undoes its claim (the pair is `pending` again, its lease dropped) and counts
against the lane's circuit breaker; one that goes through counts for it.
"""

from __future__ import annotations

import logging
from typing import Any

from animastor_tasks.domain import liveness
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import lanes
from animastor_tasks.ports import Claim, Ports

log = logging.getLogger("animastor.dispatch")


def publish_claims(
    ports: Ports, book: str, claims: list[Claim], specs: dict[str, StageSpec], breaker_clean: dict[str, bool]
) -> tuple[list[str], list[Claim]]:
    """Each claim's job to its stage's queue: (the dispatch ids published, the claims the broker refused)."""
    published: list[str] = []
    failed: list[Claim] = []
    for claim in claims:
        spec = specs[claim.stage]
        try:
            ports.publisher.publish_job(spec.task_name, spec.queue, claim.dispatch_id, job_kwargs(book, claim))
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
            _record(ports, spec.queue, False)
            continue
        published.append(claim.dispatch_id)
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
    try:
        if failed:
            ports.assets.unclaim(book, failed)
            drop_leases(ports, book, failed)
    finally:  # a published test job closes its lane's breaker whatever became of the refused claims
        for stage in {c.stage for c in claims if c not in failed}:
            queue = specs[stage].queue
            if not breaker_clean.get(queue, False) and _record(ports, queue, True) == "recovered":
                # Its pairs behind the test permit go now too; the pass hands the lane's spare slots on itself.
                lanes.breaker_closed(ports, queue, book, hand_on=False)
    return published, failed


def _record(ports: Ports, queue: str, ok: bool) -> str | None:
    """A publish's verdict on the lane's breaker, best effort. *Why:* a Redis blip (the broker's own Redis, say)
    failed the record of a refused publish too, and the pass stopped there: the refused pair kept its claim under a
    day-long queued lease with no message, and the claims after it went unpublished, until reconcile."""
    settings = ports.settings
    try:
        return ports.breaker.breaker_record(queue, ok, settings.breaker_threshold, settings.breaker_cooldown_seconds)
    except StoreUnavailable as err:
        log.warning("[DISPATCH] breaker of %s not told of a publish (%s): %s", queue, "ok" if ok else "failed", err)
        return None


def drop_leases(ports: Ports, book: str, claims: list[Claim]) -> None:
    """The leases of claims that did not commit or were not published (compare-and-delete on their dispatch
    ids), in one round trip; best-effort, the caller's trouble being the one to report."""
    try:
        ports.leases.release_leases([((book, *claim.pair), claim.dispatch_id) for claim in claims])
    except StoreUnavailable as err:
        log.warning(
            "[DISPATCH] book=%r leases of %d claim(s) that did not commit not dropped: %s", book, len(claims), err
        )


def claim_lease(book: str, claim: Claim, spec: StageSpec, now: float) -> tuple[Any, str, int, dict[str, Any]]:
    meta = {
        "book": book,
        "chapter": claim.chapter,
        "scene": claim.scene,
        "stage": claim.stage,
        "token": claim.token,
        "queue": spec.queue,
        "dispatched_at": now,
    }
    # A queued lease (domain/liveness.py): held until a worker starts the job, which shortens it to lease_ttl.
    return (book, *claim.pair), claim.dispatch_id, liveness.queued_lease_ttl(), meta


def job_kwargs(book: str, claim: Claim) -> dict[str, Any]:
    return {
        "book_id": book,
        "chapter_id": claim.chapter,
        "scene_id": claim.scene,
        "stage": claim.stage,
        "dispatch_id": claim.dispatch_id,
        "fencing_token": claim.token,
    }
