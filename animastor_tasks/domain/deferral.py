"""How long a dispatch outcome keeps its pair out of the next gate passes."""

from __future__ import annotations

from dataclasses import dataclass

from animastor_tasks.domain.vocabulary import CAPACITY, FENCE, IDEMPOTENT, DeferralBucket, Outcome


@dataclass(frozen=True)
class DeferralWindows:
    capacity_seconds: int = 60
    idempotent_seconds: int = 900


def deferral_bucket(outcome: Outcome) -> DeferralBucket | None:
    """The deferral bucket of an outcome, or None when the outcome is not deferred."""
    if outcome in CAPACITY:
        return DeferralBucket.CAPACITY
    if outcome in IDEMPOTENT:
        return DeferralBucket.IDEMPOTENT
    if outcome in FENCE:
        return DeferralBucket.FENCE
    return None


def deferral_seconds(outcome: Outcome, windows: DeferralWindows) -> int | None:
    """A capacity gap retries within a minute; done or fenced work waits the long window."""
    bucket = deferral_bucket(outcome)
    if bucket is None:
        return None
    return windows.capacity_seconds if bucket is DeferralBucket.CAPACITY else windows.idempotent_seconds


def compute_backoff(attempt: int, *, base: float, maximum: float) -> float:
    """Capped exponential backoff for the n-th retry (attempt counts from 1); never sleeps."""
    if attempt < 1:
        return 0.0
    return float(min(maximum, base * (2 ** (attempt - 1))))
