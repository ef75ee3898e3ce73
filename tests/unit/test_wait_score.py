"""A lane's waiting list order: priority first, then who waited longest; a book just served waits behind both."""

from __future__ import annotations

import time

from animastor_tasks.domain.deferral import RANK_SCALE, served_since, wait_score
from animastor_tasks.domain.vocabulary import Priority, priority_rank

CENTURY = 100 * 365 * 86400


def test_a_served_book_keeps_its_priority_and_waits_behind_every_book_that_comes_later() -> None:
    now = time.time()
    for priority in Priority:
        rank = priority_rank(priority)
        for when in (now, now + CENTURY):  # good until 2125 at least
            served = wait_score(rank, served_since(when))
            assert int(served // RANK_SCALE) == rank  # what the snapshot and lane_take.lua read back as its priority
            assert wait_score(rank, when + CENTURY) < served  # a book that comes to wait within a century after
            assert served < wait_score(rank + 1, 0.0)  # before every book of a less urgent priority


def test_books_served_one_after_the_other_keep_that_order() -> None:
    """Old code: every book served waited at one score (2255), and the list ordered them by book id: a slot handed on
    while only served books waited went to the lowest id each time, not to the one served first."""
    now = time.time()
    assert wait_score(1, served_since(now)) < wait_score(1, served_since(now + 0.001))
