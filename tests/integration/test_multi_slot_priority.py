"""Several slots freed at once (Stop All, a takeover of several dead jobs) go to the books of the most urgent priority
waiting, not one to each book from the head whatever its priority. *Why:* with a reader's book (two interactive
scenes) and a bulk book waiting, each was handed one slot; the bulk book's refill, run first (two control processes),
took its slot and started a bulk job while the reader's second scene waited for it."""

from __future__ import annotations

import pytest

from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, takeover
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book
from .test_elastic_share import lane, run_control, running, waiting

ORDERS = {"oldest_first": False, "newest_first": True}


def stopped_beside(rt: Wiring, reader_scenes: int, order: str) -> None:
    """`stopped` holds both slots of the lane; a reader's interactive book and a bulk book wait for it; a Stop All
    of `stopped` frees both slots, and the control messages run in `order`."""
    lane(rt, lane_limit=2, book_quota=4, window=4)
    for book, scenes in (("stopped", 2), ("reader", reader_scenes), ("bulk", 3)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "stopped", ["audio"])
    regenerate_flow.regenerate(rt.ports, "bulk", ["audio"], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], priority="interactive")
    assert running(rt, "stopped") == {"stopped": 2}
    assert list(waiting(rt)) == ["reader", "bulk"]
    cancel_flow.cancel(rt.ports, "stopped")
    run_control(rt, newest_first=ORDERS[order])


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_stop_all_s_two_slots_go_to_the_reader_s_two_interactive_scenes_not_one_to_a_bulk_book(
    rt: Wiring, order: str
) -> None:
    """Old code, newest first: `running == {'reader': 1, 'bulk': 1}`."""
    stopped_beside(rt, 2, order)
    assert running(rt, "reader", "bulk") == {"reader": 2}
    assert "bulk" in waiting(rt)


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_the_slot_the_reader_has_no_use_for_goes_on_to_the_bulk_book(rt: Wiring, order: str) -> None:
    """The slots the most urgent books cannot use still reach the less urgent ones: no slot idles while work waits."""
    stopped_beside(rt, 1, order)
    assert running(rt, "reader", "bulk") == {"reader": 1, "bulk": 1}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_a_takeover_s_two_slots_go_back_to_the_reader_s_two_dead_interactive_jobs(rt: Wiring, order: str) -> None:
    """Old code, newest first: the bulk book took one of the two slots the reader's dead jobs freed."""
    lane(rt, lane_limit=2, book_quota=10, window=10)
    rt.catalog.import_book(make_book("reader", chapters=1, scenes=2))
    rt.catalog.import_book(make_book("bulk", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], priority="interactive")
    regenerate_flow.regenerate(rt.ports, "bulk", ["audio"], priority="bulk")
    assert running(rt, "reader", "bulk") == {"reader": 2}
    with rt.db.transaction() as conn:
        rows = conn.execute("SELECT scene_id, dispatch_id FROM asset_states WHERE book_id = 'reader'").fetchall()
    for scene, dispatch_id in rows:  # the worker died before it started them: messages and leases gone
        rt.redis.client.delete(rt.redis.keys.lease("reader", "ch1", scene, "audio"), rt.redis.keys.queued(dispatch_id))
    takeover.on_tick(rt.ports)
    run_control(rt, newest_first=ORDERS[order])
    for book in rt.ports.book_state.take_due(rt.ports.clock()).due:
        gate.gate_pass(rt.ports, book)
    assert running(rt, "reader", "bulk") == {"reader": 2}
