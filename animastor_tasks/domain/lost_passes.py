"""How the tick sends again the gate passes lost with their holder's process (flow/pass_hold.py).

A book lost once goes in the usual batches; one whose passes were lost `ALONE_AFTER_LAPSES` times in a row goes in
a batch of its own (its pass may be what kills the process: it takes no other book's pass with it); one lost
`GIVEN_UP_AFTER_LAPSES` times is not sent again for its lapse, only when something else makes it due (reconcile's
round, a regenerate, a job's end), and then alone. Its count is forgotten when a pass of it ends.
*Why:* each lost book alone, a deploy's kill of 4 control processes was 200 messages in one tick; never given up, a
book whose pass kills its process killed one every 25 s for ever; forgotten when given up, it came back with
reconcile's round counted from 1, its first kill taking its batch's other books with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ALONE_AFTER_LAPSES = 2
GIVEN_UP_AFTER_LAPSES = 3


@dataclass(frozen=True)
class Resend:
    batched: list[str]  # in the usual batches
    alone: list[str]  # each in a batch of its own
    given_up: list[str]  # lapsed now, and not sent


def sort_passes(due: Sequence[str], lapsed: Sequence[str], lapses: Mapping[str, int]) -> Resend:
    """The books to pass now: `due` (the due index, the caller's own) and `lapsed` (whose held pass lapsed now);
    `lapses`: book -> how many of its passes were lost in a row, this take's counted."""
    asked = set(due)
    given_up = [b for b in lapsed if b not in asked and lapses.get(b, 0) >= GIVEN_UP_AFTER_LAPSES]
    books = [b for b in dict.fromkeys([*due, *lapsed]) if b not in given_up]
    alone = [b for b in books if lapses.get(b, 0) >= ALONE_AFTER_LAPSES]
    return Resend([b for b in books if lapses.get(b, 0) < ALONE_AFTER_LAPSES], alone, given_up)
