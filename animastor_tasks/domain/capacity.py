"""Which pending pairs get a GPU slot now: the lane limit, the book cap, and the fair share
(book quota and scene window) that binds only while another book waits for the lane.

Pure: the counts are read under the lane and book locks (`ports.Assets.claiming`), this
picks, and the claim is written in the same transaction, so two passes never overfill a
lane. A refused pair is named with the limit it hit, so it can be deferred for it.

*Why elastic:* a hard quota left GPUs idle while one book alone had work for them. A book
alone on a lane uses every free slot; once other books wait it gets no slot beyond its share
and gives the extra back as its jobs end (nothing is preempted). `book_cap` stays a hard cap.

Priority comes before the share: only a waiter at least as urgent as a pair binds the share for
it, and a pair takes none of the free slots that more urgent books wait for whose shares would not refuse
them (one each; below their shares, or at them with no book as urgent below its own waiting), nor those of
the books of its priority that waited longer or were handed a slot, but in a claim of a slot handed to it. *Why:* a bulk
book waiting held a reader's interactive scene to its book's share, the slot going to bulk work; and a book
whose interactive scene its window refused ran its bulk scenes while another reader waited.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import Outcome, Priority, priority_rank

NORMAL_RANK = priority_rank(Priority.NORMAL)
# How long a book handed a slot keeps it from less urgent passes before its refill claims it: a refill on its way
# takes milliseconds; one not back by then was likely lost (the tick puts its book back on the list), and held for
# longer its slot would idle meanwhile.
HANDED_HOLD_SECONDS = 5.0


@dataclass(frozen=True)
class Waiter:
    """Another book waiting for a slot of a lane: the priority rank it waits at, and its generating pairs.
    `handed`: handed a slot already, its refill on its way (it holds a slot from less urgent pairs, and binds no fair
    share: a hand-over to several books shares the slots out itself). `ahead`: before the claiming book at its
    priority (earlier on the list, or handed a slot), unless that book's claim is of a slot handed to it."""

    rank: int
    generating: Sequence[Pair]
    handed: bool = False
    ahead: bool = False


@dataclass(frozen=True)
class CapacityCounts:
    lane: Mapping[str, int]  # generating pairs per stage, across every book
    book_generating: Sequence[Pair]  # the book's own generating pairs
    # Per stage, the other books waiting for a slot of its lane (the head of the lane's waiting list).
    # None: not known, so the fair share binds as if someone as urgent waited.
    waiting: Mapping[str, Sequence[Waiter]] | None = None


@dataclass
class CapacityChoice:
    chosen: list[tuple[Pair, str]] = field(default_factory=list)  # (pair, dispatch id) to claim
    refused: dict[Outcome, list[Pair]] = field(default_factory=dict)  # by the limit each hit
    # Stages whose lane the book now waits for (refused by the lane or by its fair share, not by its
    # cap): it joins their waiting lists so that a freed slot is handed to it, at the priority of the most
    # urgent of `waiting`, the pairs so refused.
    waits_for: set[str] = field(default_factory=set)
    waiting: set[Pair] = field(default_factory=set)


def below_share(generating: Sequence[Pair], stage: str, spec: StageSpec) -> bool:
    """Whether a book running `generating` could still take a slot of `stage` within its fair share."""
    used = sum(1 for _, _, s in generating if s == stage)
    scenes = {(chapter, scene) for chapter, scene, _ in generating}
    capped = spec.book_cap is not None and used >= spec.book_cap
    return used < spec.book_quota and not capped and len(scenes) < spec.window


def contested(stage: str, rank: int, counts: CapacityCounts, spec: StageSpec, *, handed: bool = True) -> bool:
    """The fair share binds for a pair of `rank`: another book at least as urgent waits for the lane and is
    still below its own share.

    A waiting book as urgent but already at its share binds nothing: its share and this pair's would bind each
    other, and the slot idle. `handed`: a book handed a slot whose refill is on its way waits too (not for a claim
    of slots of its own: theirs are the lane's others). *Why:* two books handed a slot each by two job ends moments
    apart, the first refill claimed both free slots past its share, and the other book ran nothing for a job."""
    if counts.waiting is None:
        return True
    return _binds(counts.waiting.get(stage, ()), rank, stage, spec, handed=handed)


def _binds(
    waiting: Sequence[Waiter], rank: int, stage: str, spec: StageSpec, but: int | None = None, *, handed: bool = False
) -> bool:
    """Whether a waiter of `waiting` (not the one at index `but`; of the handed ones, only with `handed`) binds the
    share of a claim at `rank`."""
    return any(
        i != but and (handed or not w.handed) and w.rank <= rank and below_share(w.generating, stage, spec)
        for i, w in enumerate(waiting)
    )


def waited_longer(places: Mapping[str, float], ranks: Mapping[str, int], book: str, now: float) -> set[str]:
    """The books before `book` on a lane's list at their priority (`places`: each one's time on it, `ranks`: the
    priority each waits at): placed earlier than its own place at that priority, or than `now`, where it would join
    at a priority it does not wait at. *Why not its place alone:* a book waiting at bulk since before a normal book
    came went before it with a normal pair, as if it had waited at normal all along."""

    def mine(other: str) -> float:
        return places.get(book, now) if book in ranks and ranks[book] == ranks.get(other) else now

    return {b for b, since in places.items() if b != book and since < mine(b)}


def could_take(waiting: Sequence[Waiter], index: int, stage: str, spec: StageSpec) -> bool:
    """Whether the waiter at `index` could take a slot of `stage` at its rank: within its book cap, and below its
    share or at it with no other waiter as urgent binding it (as `contested` decides for its own claim).

    *Why not below its share alone:* a reader's book running 4 bulk audio scenes (window 4) was at its share, though
    no book as urgent contested the lane, so nothing held the image slot its interactive scene was handed and a bulk
    book's pass took it: the reader's scene waited a whole bulk job."""
    waiter = waiting[index]
    used = sum(1 for _, _, s in waiter.generating if s == stage)
    if spec.book_cap is not None and used >= spec.book_cap:
        return False
    return below_share(waiter.generating, stage, spec) or not _binds(waiting, waiter.rank, stage, spec, index)


def outranking(stage: str, rank: int, counts: CapacityCounts, spec: StageSpec, *, handed: bool = True) -> int:
    """How many books before a pair of `rank` that could take a slot (`could_take`) wait for the lane: as many free
    slots are theirs (one each: a book that can use more is handed more as the slots go round). Before it: more
    urgent, or as urgent and `ahead`. `handed`: not a claim of slots of its own (theirs are the lane's others: only
    more urgent waiters, not handed ones, go first).

    *Why the books as urgent:* a book whose regenerate came as a slot freed (its job's refill not yet claimed) took
    it from the book that had waited for the lane longest: of 300 books sent together, books sent 75-250 places later
    first started before books that had waited 1-3 s longer."""
    waiting = (counts.waiting or {}).get(stage, ())
    return sum(
        1
        for i, w in enumerate(waiting)
        if (handed or not w.handed)
        and (w.rank < rank or (handed and w.rank == rank and w.ahead))
        and could_take(waiting, i, stage, spec)
    )


def choose(
    wanted: Sequence[tuple[Pair, str]],
    counts: CapacityCounts,
    specs: Mapping[str, StageSpec],
    permits: Mapping[str, int],
    room: Mapping[str, int] | None = None,
    ranks: Mapping[Pair, int] | None = None,
) -> CapacityChoice:
    """Take `wanted` in order (reading order within priority: the window's order) while the limits allow.

    `permits` caps a stage whose breaker is half-open (one test dispatch); a pair past its
    permit is neither chosen nor refused: it waits for the breaker, not for capacity.
    `room` caps the slots of a stage's lane this claim may take (a finished job's own slot): past
    it the lane is full for this claim, and the pair waits for the lane like any refused by it.
    `ranks`: each pair's priority rank (0 most urgent; a pair not in it is `normal`).
    """
    lane = Counter({stage: int(n) for stage, n in counts.lane.items()})
    quota: Counter[str] = Counter(stage for _, _, stage in counts.book_generating)
    window = {(chapter, scene) for chapter, scene, _ in counts.book_generating}
    slots = dict(room or {})
    waits = {
        (stage, rank): (
            contested(stage, rank, counts, spec, handed=stage not in slots),
            outranking(stage, rank, counts, spec, handed=stage not in slots),
        )
        for stage, spec in specs.items()
        for rank in range(len(Priority))
    }
    left = dict(permits)
    choice = CapacityChoice()
    for pair, dispatch_id in wanted:
        chapter, scene, stage = pair
        spec = specs[stage]
        if left.get(stage, 1) <= 0:
            continue
        rank = NORMAL_RANK if ranks is None else ranks.get(pair, NORMAL_RANK)
        shared, reserved = waits[stage, rank]
        free = spec.lane_limit - lane[stage]
        if stage in slots:  # the lane's other free slots are other refills' to fill
            free = min(free, slots[stage])
        refusal: Outcome | None = None
        if free <= reserved:  # reserved >= 0: a full lane too
            refusal = Outcome.LANE_FULL
        elif spec.book_cap is not None and quota[stage] >= spec.book_cap:
            choice.refused.setdefault(Outcome.QUOTA_EXHAUSTED, []).append(pair)
            continue  # the hard cap: more slots would not help, so the book does not wait for the lane
        elif shared and quota[stage] >= spec.book_quota:
            refusal = Outcome.QUOTA_EXHAUSTED
        elif shared and (chapter, scene) not in window and len(window) >= spec.window:
            refusal = Outcome.WINDOW_FULL
        if refusal is not None:
            choice.refused.setdefault(refusal, []).append(pair)
            choice.waits_for.add(stage)
            choice.waiting.add(pair)
            continue
        choice.chosen.append((pair, dispatch_id))
        lane[stage] += 1
        quota[stage] += 1
        window.add((chapter, scene))
        if stage in left:
            left[stage] -= 1
        if stage in slots:
            slots[stage] -= 1
    return choice


def share_slots(slots: int, books: int) -> list[int]:
    """`slots` free slots of a lane split among the `books` handed them, head first: one each in turn
    (round robin), the first ones one more when they do not divide evenly."""
    if books <= 0:
        return []
    each, extra = divmod(slots, books)
    return [each + (i < extra) for i in range(books)]
