"""How long a dispatch outcome keeps its pair out of the next gate passes."""

from __future__ import annotations

from dataclasses import dataclass

from animastor_tasks.domain.vocabulary import CAPACITY, IDEMPOTENT, DeferralBucket, Outcome


@dataclass(frozen=True)
class DeferralWindows:
    capacity_seconds: int = 60
    idempotent_seconds: int = 900


def deferral_bucket(outcome: Outcome) -> DeferralBucket | None:
    """The deferral bucket of an outcome, or None when the outcome is not deferred.

    `fence_rejected` is not deferred: the refused job was a stale dispatch, and its pair already
    belongs to newer work (or to nobody) that a deferral would only hold back.
    """
    if outcome in CAPACITY:
        return DeferralBucket.CAPACITY
    if outcome in IDEMPOTENT:
        return DeferralBucket.IDEMPOTENT
    return None


def deferral_seconds(outcome: Outcome, windows: DeferralWindows) -> int | None:
    """A capacity gap retries within a minute; done or running work waits the long window."""
    bucket = deferral_bucket(outcome)
    if bucket is None:
        return None
    return windows.capacity_seconds if bucket is DeferralBucket.CAPACITY else windows.idempotent_seconds


def compute_backoff(attempt: int, *, base: float, maximum: float) -> float:
    """Capped exponential backoff for the n-th retry (attempt counts from 1); never sleeps."""
    if attempt < 1:
        return 0.0
    return float(min(maximum, base * (2 ** (attempt - 1))))


def retry_delay(attempt: int, *, base: float, maximum: float, asked: float | None) -> float:
    """The wait before the next attempt: the backoff, or longer when the backend asked for longer (`Retry-After`),
    both capped at `maximum`. Retried at the backoff alone, a rate-limited server refused every attempt and the
    pair failed in seconds, inside the window the server had named."""
    backoff = compute_backoff(attempt, base=base, maximum=maximum)
    return backoff if asked is None else max(backoff, min(asked, maximum))


RANK_SCALE = 1e10  # one priority rank outweighs any unix time: `wait_score`, and lua/lane_take.lua
SERVED_AFTER = 5e9  # seconds: past any unix time until 2128, and with one added, still below `RANK_SCALE`


def served_since(now: float) -> float:
    """Where a book just served a slot of a lane waits for its pairs still refused there: behind every book of its
    priority that waits or comes to wait while that job runs; its end puts the book at that time (the re-queue of
    lua/lane_take.lua), as a refusal does once the job could have ended (lua/lane_wait.lua); books served earlier
    first. *Why:* placed at the time it was served, a book that had a job running went before the books whose
    commands came during that job: of 40 books sent together, the last four first started behind the second jobs of
    books whose first had begun before they came."""
    return SERVED_AFTER + now


def wait_score(rank: int, since: float) -> float:
    """A book's place on a lane's waiting list: the most urgent priority first, then who waited
    longest (`since`, unix seconds; 0 puts the book at the head of its priority)."""
    return rank * RANK_SCALE + since
