"""A command's targets: what a regenerate does to each, why a target is released, how a command settles.

Pure rules; the adapters run them as SQL parameters or over counts they read, so the rule is
written once and tested without a store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from animastor_tasks.domain.gate import BookFacts, Denial, decide
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import AssetState, CommandStatus


class Take(StrEnum):
    """What a regenerate does to one target pair, by the pair's state and the command's force."""

    QUEUE = "queue"  # -> pending: queued work for this command
    JOIN = "join"  # left as it is: the work queued or running already serves the new command
    RERUN = "rerun"  # forced over a running job: that job is fenced off and stopped, then a fresh run


def regenerate_take(state: AssetState | str, force: bool) -> Take:
    """`pending` joins (queued already). `generating` joins the running job unless forced: without force
    its commit completes the new command; with force the reader asked for a fresh run, so the running
    job must neither complete it nor keep running, and its slot counts until it has stopped. (A running job
    that started from other inputs than its scene's now is rerun without force too: the command store reads
    that, `job_starts.input_hash`.)"""
    state = AssetState(state)
    if state == AssetState.PENDING:
        return Take.JOIN
    if state == AssetState.GENERATING:
        return Take.RERUN if force else Take.JOIN
    return Take.QUEUE


def states_taking(take: Take, force: bool) -> frozenset[AssetState]:
    """The states a regenerate gives `take` (the SQL compare-and-set takes these)."""
    return frozenset(s for s in AssetState if regenerate_take(s, force) == take)


STOP_MARKER_PREFIX = "stopping:"


def stop_marker(dispatch_id: str) -> str:
    """The value a fenced-off job's lease is swapped for: its renewal (compare on its dispatch id) fails,
    so it stops, while the pair still reads as held: its watcher renews the marker until the job has
    returned, and a job whose worker died leaves it to lapse one lease TTL later."""
    return f"{STOP_MARKER_PREFIX}{dispatch_id}"


# Why a re-import released a target: its scene is gone, or the media made for it is stale (the input changed).
SCENE_REMOVED = "scene_removed"
INPUT_CHANGED = "input_changed"


def release_reason(facts: BookFacts, pair: Pair) -> str | None:
    """Why a target of an active command, just released to `dirty`, can no longer progress.

    `facts` are the book's Postgres facts with the pair commanded. None when they still authorize it
    (the release came from the Redis cancel flag: Stop All settles its commands itself) or when the
    book is tombstoned (cancel again): such a target is not counted as released.
    """
    denial = decide(facts, pair)
    if denial is None or denial == Denial.CANCELLED:
        return None
    return str(denial)


@dataclass(frozen=True)
class TargetCounts:
    """One command's targets: released ones by reason, the others by their pair's state."""

    total: int
    ready: int = 0
    failed: int = 0
    released: Mapping[str, int] = field(default_factory=dict)

    @property
    def open(self) -> int:
        return self.total - self.ready - self.failed - sum(self.released.values())


def settle(counts: TargetCounts) -> tuple[CommandStatus, str | None] | None:
    """The status an active command ends with, or None while a target can still progress.

    Every target ready -> completed. Otherwise, once none is open, failed with a reason that counts
    the failed and the released targets ("2 of 20 targets released (layer_disabled)").
    """
    if counts.open > 0:
        return None
    released = {reason: n for reason, n in sorted(counts.released.items()) if n}
    if not counts.failed and not released:
        return CommandStatus.COMPLETED, None
    parts = [f"{counts.failed} of {counts.total} targets failed"] if counts.failed else []
    parts += [f"{n} of {counts.total} targets released ({reason})" for reason, n in released.items()]
    return CommandStatus.FAILED, "; ".join(parts)
