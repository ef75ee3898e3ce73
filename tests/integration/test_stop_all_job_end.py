"""A Stop All between a job's commit and the hand-over of the slot it freed (`lua/lane_take.lua`): the commit read
what the book had left before the Stop All's Postgres step, its Redis step took the book off every waiting list, and
the hand-over, run after, put the stopped book back on the list (or let it keep the slot) for work it no longer has.
The hand-over reads the book's cancel flag in the same step."""

from __future__ import annotations

import pytest

from animastor_tasks.domain.vocabulary import Priority, priority_rank
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import refill
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.records import Committed
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book
from .test_elastic_share import lane, running, waiting
from .test_kept_place import ended_unseen


@pytest.mark.parametrize("priority", [Priority.NORMAL, Priority.INTERACTIVE])
def test_a_book_stopped_after_its_job_s_commit_is_not_put_back_on_the_waiting_list(rt: Wiring, priority) -> None:
    """Normal: queued again behind the waiter, it drew a later slot whose refill found nothing. Interactive: it kept
    the freed slot outright, its refill found nothing, and the slot went to the waiter through the control queue."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book in ("c", "w"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "c", ["audio"], priority=priority)
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])
    assert running(rt, "c", "w") == {"c": 1}
    dispatch_id = ended_unseen(rt, "c")  # its commit read c's pending s2
    cancel_flow.cancel(rt.ports, "c")  # Stop All: c off every waiting list
    refill.free_slot(rt.ports, "c", "gpu.audio", dispatch_id, here=True, left=Committed(priority_rank(priority)))
    assert "c" not in waiting(rt)
    assert running(rt, "c", "w") == {"w": 1}  # the slot went to the waiter in this process, no control hop
