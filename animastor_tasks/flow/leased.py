"""How long a pair whose lease another run holds waits (`already_generating`), read from the lease itself."""

from __future__ import annotations

import math

from animastor_tasks.domain.deferral import deferral_seconds
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import DeferralBucket, Outcome
from animastor_tasks.ports import Ports


def defer_while_leased(ports: Ports, book: str, pairs: list[Pair], now: float) -> dict[Pair, float]:
    """`already_generating` for as long as each pair's lease has left, at most the idempotent window and the stage's
    lease TTL. *Why:* the lease of a job that ended but whose release was lost (a Redis blip) lives out its TTL, and
    the pair, edited and regenerated meanwhile, waited the whole window (900 s) with nothing running; a live job
    renews its lease, and the next pass finds it again. A queued lease lasts a day: one a half-done Stop All left
    (its Redis step failed) deferred the pair 900 s, though its job, refused at its start, holds it a TTL at most. When
    each may go, by pair."""
    window = deferral_seconds(Outcome.ALREADY_GENERATING, ports.settings.deferral_windows) or 0
    registry = ports.settings.registry
    left = ports.leases.lease_seconds_left([(book, *pair) for pair in pairs])
    by_seconds: dict[int, list[Pair]] = {}
    for pair, seconds in zip(pairs, left, strict=True):
        ttl = registry.get(pair[2]).lease_ttl if pair[2] in registry else window
        by_seconds.setdefault(min(window, ttl, max(1, math.ceil(seconds or 0))), []).append(pair)
    until: dict[Pair, float] = {}
    for seconds, held in by_seconds.items():
        ports.deferrals.defer(book, DeferralBucket.IDEMPOTENT, held, seconds, now)
        until.update(dict.fromkeys(held, now + seconds))
    return until
