"""The dispatch outcome taxonomy and what each bucket costs."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    DISPATCHED = "dispatched"
    DEFERRED = "deferred_capacity"  # a live deferral: skipped with no side effect
    LANE_FULL = "lane_full"
    QUOTA_EXHAUSTED = "quota_exhausted"
    WINDOW_FULL = "window_full"
    ALREADY_COMPLETED = "already_completed"
    ALREADY_GENERATING = "already_generating"
    FENCE_REJECTED = "fence_rejected"
    BLOCKED = "blocked"  # no consumer on the stage's queue
    BREAKER_OPEN = "breaker_open"
    PUBLISH_FAILED = "publish_failed"


CAPACITY = frozenset({Outcome.LANE_FULL, Outcome.QUOTA_EXHAUSTED, Outcome.WINDOW_FULL})
IDEMPOTENT = frozenset({Outcome.ALREADY_COMPLETED, Outcome.ALREADY_GENERATING})
FENCE = frozenset({Outcome.FENCE_REJECTED})
ERRORS = frozenset({Outcome.PUBLISH_FAILED, Outcome.BREAKER_OPEN})


@dataclass(frozen=True)
class DeferralWindows:
    capacity_seconds: int = 60
    idempotent_seconds: int = 900


def deferral_bucket(outcome: Outcome) -> str | None:
    """The deferral bucket of an outcome, or None when the outcome is not deferred."""
    if outcome in CAPACITY:
        return "capacity"
    if outcome in IDEMPOTENT:
        return "idempotent"
    if outcome in FENCE:
        return "fence"
    return None


def deferral_seconds(outcome: Outcome, windows: DeferralWindows) -> int | None:
    """A capacity gap retries within a minute; done or fenced work waits the long window."""
    bucket = deferral_bucket(outcome)
    if bucket is None:
        return None
    return windows.capacity_seconds if bucket == "capacity" else windows.idempotent_seconds


def no_worker_reason(stage: str) -> str:
    return f"no_worker:{stage}"


def compute_backoff(attempt: int, *, base: float, maximum: float) -> float:
    """Capped exponential backoff for the n-th retry (attempt counts from 1); never sleeps."""
    if attempt < 1:
        return 0.0
    return float(min(maximum, base * (2 ** (attempt - 1))))
