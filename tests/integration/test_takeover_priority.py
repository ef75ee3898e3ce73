"""A dead worker's slot follows the rule of a job's end: the book whose pair the takeover sent back to `pending`
waits for the lane at that pair's priority before the slot is handed on, so a reader's interactive scene is not
passed by normal work; at the same priority the book that waited longer still goes first (round robin)."""

from __future__ import annotations

from animastor_tasks.flow import gate, takeover
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book, states
from .test_elastic_share import lane, run_control, running, waiting


def _lose_job(rt: Wiring, book: str) -> None:
    """The worker of `book`'s only job died before it started it: its message and its lease are gone."""
    with rt.db.transaction() as conn:
        (dispatch_id,) = conn.execute("SELECT dispatch_id FROM asset_states WHERE book_id = %s", (book,)).fetchone()
    rt.redis.client.delete(rt.redis.keys.lease(book, "ch1", "s1", "audio"), rt.redis.keys.queued(dispatch_id))


def _tick_takes_over(rt: Wiring) -> None:
    """The tick's takeover, the refill it hands the freed slot to, then the tick's due passes."""
    takeover.on_tick(rt.ports)
    run_control(rt)
    for book in rt.ports.book_state.take_due(rt.ports.clock()).due:
        gate.gate_pass(rt.ports, book)


def test_a_dead_interactive_job_s_slot_goes_back_to_its_reader_not_to_a_normal_waiter(rt: Wiring) -> None:
    """Old code: the slot went to the normal book at the head of the list (`running == {'n': 1}`), and the reader's
    scene, `pending` again, waited for the next job's end on the lane."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    rt.catalog.import_book(make_book("reader", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("n", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], priority="interactive")  # the only slot
    regenerate_flow.regenerate(rt.ports, "n", ["audio"])  # normal: waits for the lane
    assert "n" in waiting(rt)
    _lose_job(rt, "reader")
    _tick_takes_over(rt)
    assert running(rt, "reader", "n") == {"reader": 1}
    assert states(rt, "reader")[("ch1", "s1", "audio")] == "generating"
    assert "n" in waiting(rt)


def test_a_dead_normal_job_s_slot_goes_to_the_normal_book_that_waited_longer(rt: Wiring) -> None:
    """At the same priority the takeover's book queues behind the books that waited already, as a job's end does."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    rt.catalog.import_book(make_book("dead", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("n", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "dead", ["audio"])  # the only slot
    regenerate_flow.regenerate(rt.ports, "n", ["audio"])  # waits for the lane
    _lose_job(rt, "dead")
    _tick_takes_over(rt)
    assert running(rt, "dead", "n") == {"n": 1}
    assert states(rt, "dead")[("ch1", "s1", "audio")] == "pending"
    assert "dead" in waiting(rt)
