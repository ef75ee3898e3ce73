"""A resent `command_id` must repeat the request it was first sent with.

The id names one request: a retry after a lost answer gets the commands it made, and nothing runs twice. A
different request under the same id used to get those commands back as well, and its own intent (other scenes,
other stages, a force, a priority) was dropped with no word to its sender.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from animastor_tasks.domain.types import SceneKey
from animastor_tasks.domain.vocabulary import Priority


@dataclass(frozen=True)
class FirstSending:
    """What the commands of a request id were made from, as stored with them."""

    book_id: str
    stages: frozenset[str]  # the stages it made commands for: a stage whose layer was off made none
    force: bool
    priority: Priority
    same_scenes: bool | None  # whether its targets are exactly the scenes this resend names; None: none named
    asked_stages: frozenset[str] | None = None  # every stage it named, `all` spelled out (None: an older version's)
    whole_book: bool | None = None  # whether it asked for the whole book rather than named scenes (None: unknown)


def resend_differs(
    first: FirstSending, book: str, wanted: Collection[str], force: bool, priority: Priority, whole_book: bool
) -> str | None:
    """What this resend changes, worded for its sender; None when it repeats the first sending. Of a first sending
    whose asked stages are unknown (an older version's), a resend naming more stages than made commands passes: it
    may have named them with their layer off."""
    if first.book_id != book:
        return "book_id"
    if first.asked_stages is not None:
        stages_differ = first.asked_stages != set(wanted)
    else:  # an older version's: only the stages that made commands are known, and a resend may name more
        stages_differ = not first.stages <= set(wanted)
    if stages_differ:
        return f"stages (first sent for {', '.join(sorted(first.asked_stages or first.stages))})"
    if first.whole_book is not None and first.whole_book != whole_book:
        return f"scenes (first sent for {'the whole book' if first.whole_book else 'named scenes'})"
    if first.same_scenes is False:
        return "scenes"
    if first.force != force:
        return f"force (first sent with {str(first.force).lower()})"
    if first.priority != priority:
        return f"priority (first sent as {first.priority})"
    return None


def spelled_out(asked: Sequence[str], known: Sequence[str]) -> frozenset[str]:
    """The stages a request named, `all` as the stages known now: a resend of `["all"]` asks what it asked."""
    return frozenset(name for stage in asked for name in (known if stage == "all" else [stage]))


def named_match(stored: int, named: Sequence[SceneKey], found: int) -> bool:
    """The first sending's targets are the named scenes: as many distinct ones, every named one among them."""
    return stored == len(set(named)) == found
