"""book_cap: a reader's interactive scene refused by its book's cap does not wait for the lane (more free slots would
not help it); when a job of that book ends, freeing the cap room the scene needs, the book is weighed at its most
urgent pending pair's priority, so the scene takes the slot ahead of normal waiters. *Why:* weighed at the priority
of the job that ended (bulk), the book gave the slot to the head of the list, and the reader's scene waited behind
every normal book (up to its 60 s capacity deferral, then a job)."""

from __future__ import annotations

from animastor_tasks.domain.deferral import RANK_SCALE
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book, states
from .test_elastic_share import finish_one, lane, running, waiting

BOOKS = ("capped", "w", "n1", "n2", "n3")


def test_an_interactive_scene_at_its_books_cap_takes_the_room_its_books_bulk_job_frees(rt: Wiring) -> None:
    lane(rt, lane_limit=4, book_quota=10, window=10, book_cap=2)
    rt.catalog.import_book(make_book("capped", chapters=1, scenes=4))
    rt.catalog.import_book(make_book("w", chapters=1, scenes=1))
    for n in ("n1", "n2", "n3"):
        rt.catalog.import_book(make_book(n, chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "capped", ["audio"], [["ch1", "s1"], ["ch1", "s2"]], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])  # a third slot; one left free
    # The reader's scene: the lane has room, the book's cap (2) refuses it; it does not wait for the lane.
    regenerate_flow.regenerate(rt.ports, "capped", ["audio"], [["ch1", "s3"]], priority="interactive")
    assert states(rt, "capped")[("ch1", "s3", "audio")] == "pending"
    for n in ("n1", "n2", "n3"):  # normal one-scene books: the first takes the last slot, the others wait
        regenerate_flow.regenerate(rt.ports, n, ["audio"])
    assert set(waiting(rt)) == {"n2", "n3"}
    finish_one(rt, "capped")  # a bulk job of `capped` ends: the cap room its interactive scene needs is free
    assert states(rt, "capped")[("ch1", "s3", "audio")] == "generating"
    assert running(rt, *BOOKS) == {"capped": 2, "w": 1, "n1": 1}
    assert set(waiting(rt)) == {"n2", "n3"}


def test_a_finishing_book_waits_at_its_most_urgent_pending_pairs_priority(rt: Wiring) -> None:
    """Its bulk job ends while its reader's scene, refused by the cap, is pending and a reader who waited longer
    holds the head: the slot goes to that reader, and the book queues at the interactive priority, not at bulk."""
    lane(rt, lane_limit=2, book_quota=10, window=10, book_cap=1)
    for book in ("capped", "x", "r"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "capped", ["audio"], [["ch1", "s1"]], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "capped", ["audio"], [["ch1", "s2"]], priority="interactive")  # its cap
    regenerate_flow.regenerate(rt.ports, "x", ["audio"], [["ch1", "s1"]], priority="interactive")  # the other slot
    regenerate_flow.regenerate(rt.ports, "r", ["audio"], [["ch1", "s1"]], priority="interactive")  # waits
    assert set(waiting(rt)) == {"r"}
    finish_one(rt, "capped")
    assert running(rt, "capped", "x", "r") == {"x": 1, "r": 1}
    assert waiting(rt)["capped"] < RANK_SCALE  # at its reader's scene's priority
