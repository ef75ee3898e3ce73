"""A lane's waiting list order: priority first, then who waited longest; a book just served waits behind both."""

from __future__ import annotations

import time

from animastor_tasks.domain.deferral import RANK_SCALE, SERVED_SINCE, wait_score
from animastor_tasks.domain.vocabulary import Priority, priority_rank


def test_a_served_book_keeps_its_priority_and_waits_behind_every_book_that_comes_later() -> None:
    now = time.time()
    for priority in Priority:
        rank = priority_rank(priority)
        served = wait_score(rank, SERVED_SINCE)
        assert int(served // RANK_SCALE) == rank  # what the snapshot and lane_take.lua read back as its priority
        assert wait_score(rank, now + 100 * 365 * 86400) < served  # a book that comes to wait within a century
        assert served < wait_score(rank + 1, 0.0)  # before every book of a less urgent priority
