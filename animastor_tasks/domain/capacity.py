"""Which pending pairs get a GPU slot now: the lane limit, the book quota and the scene window.

Pure: the counts are read under the lane and book locks (`ports.Assets.claiming`), this
picks, and the claim is written in the same transaction, so two passes never overfill a
lane. A refused pair is named with the limit it hit, so it can be deferred for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import Outcome


@dataclass(frozen=True)
class CapacityCounts:
    lane: Mapping[str, int]  # generating pairs per stage, across every book
    book_generating: Sequence[Pair]  # the book's own generating pairs


@dataclass
class CapacityChoice:
    chosen: list[tuple[Pair, str]] = field(default_factory=list)  # (pair, dispatch id) to claim
    refused: dict[Outcome, list[Pair]] = field(default_factory=dict)  # by the limit each hit


def choose(
    wanted: Sequence[tuple[Pair, str]],
    counts: CapacityCounts,
    specs: Mapping[str, StageSpec],
    permits: Mapping[str, int],
) -> CapacityChoice:
    """Take `wanted` in order while the limits allow.

    `permits` caps a stage whose breaker is half-open (one test dispatch); a pair past its
    permit is neither chosen nor refused: it waits for the breaker, not for capacity.
    """
    lane = Counter({stage: int(n) for stage, n in counts.lane.items()})
    quota: Counter[str] = Counter(stage for _, _, stage in counts.book_generating)
    window = {(chapter, scene) for chapter, scene, _ in counts.book_generating}
    left = dict(permits)
    choice = CapacityChoice()
    for pair, dispatch_id in wanted:
        chapter, scene, stage = pair
        spec = specs[stage]
        if left.get(stage, 1) <= 0:
            continue
        refusal: Outcome | None = None
        if lane[stage] >= spec.lane_limit:
            refusal = Outcome.LANE_FULL
        elif quota[stage] >= spec.book_quota:
            refusal = Outcome.QUOTA_EXHAUSTED
        elif (chapter, scene) not in window and len(window) >= spec.window:
            refusal = Outcome.WINDOW_FULL
        if refusal is not None:
            choice.refused.setdefault(refusal, []).append(pair)
            continue
        choice.chosen.append((pair, dispatch_id))
        lane[stage] += 1
        quota[stage] += 1
        window.add((chapter, scene))
        if stage in left:
            left[stage] -= 1
    return choice
