"""Priority on the task contract: kept on the command, first in line for a free slot, refused when unknown."""

from __future__ import annotations

from dataclasses import replace

import pytest

from animastor_tasks.errors import InvalidCommand
from animastor_tasks.flow import gate
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import advertise, make_book, states, use_settings
from .test_elastic_share import lane, waiting


@pytest.fixture
def one_slot(rt):  # type: ignore[no-untyped-def]
    """One audio slot, quota and window wide enough that only the lane limits."""
    spec = rt.settings.registry.get("audio")
    lane = replace(spec, lane_limit=1, book_quota=10, window=10)
    use_settings(rt, replace(rt.settings, registry=replace(rt.settings.registry, stages=(lane,))))
    advertise(rt, "gpu.audio")
    return rt


@pytest.mark.parametrize("priority", ["urgent", "", 3, ["interactive"]])
def test_an_unknown_priority_is_refused_and_writes_nothing(rt, priority: object) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    with pytest.raises(InvalidCommand, match="priority: must be one of interactive, normal, bulk"):
        regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority=priority)
    assert rt.ports.commands.commands(book="b") == []
    assert set(states(rt, "b").values()) == {"dirty"}


def test_the_priority_is_kept_on_the_command(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority="bulk")
    with rt.db.transaction() as conn:
        assert conn.execute("SELECT priority FROM commands WHERE book_id = 'b'").fetchall() == [("bulk",)]


def test_an_interactive_scene_goes_before_the_books_bulk_scenes(one_slot) -> None:
    rt = one_slot
    rt.catalog.import_book(make_book("b", chapters=1, scenes=5))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority="bulk")  # s1 takes the slot
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s4"]], priority="interactive")
    with rt.db.transaction() as conn:  # the running job ends
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'b' AND scene_id = 's1'")
    rt.redis.client.delete(rt.redis.keys.deferrals("b", "capacity"))  # as the end of its job clears them
    gate.gate_pass(rt.ports, "b")
    assert states(rt, "b")[("ch1", "s4", "audio")] == "generating"  # not s2, next in reading order


def test_an_interactive_book_is_handed_the_next_free_slot_before_books_that_waited_longer(one_slot) -> None:
    rt = one_slot
    for book in ("running", "bulk1", "bulk2", "reader"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "running", ["audio"], [["ch1", "s1"]])  # takes the only slot
    regenerate_flow.regenerate(rt.ports, "bulk1", ["audio"], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "bulk2", ["audio"], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], [["ch1", "s2"]], priority="interactive")
    # Several slots go to the books of the head's priority alone; those of the next priority, in turn, after them.
    assert rt.deferrals.next_waiters("gpu.audio", 3) == ["reader"]
    assert rt.deferrals.next_waiters("gpu.audio", 3) == ["bulk1", "bulk2"]


def test_a_full_pass_orders_a_pair_by_its_most_urgent_command_s_age_as_a_refill_does(one_slot) -> None:
    """Old code: a full pass gave a pair the age of its oldest command of any priority: both scenes took the bulk
    command's and went in reading order, s1 first, although s3's interactive command was the older."""
    rt = one_slot
    rt.catalog.import_book(make_book("x", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])  # takes the only slot
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s3"]], priority="interactive")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s1"]], priority="interactive")
    with rt.db.transaction() as conn:  # x's job ends
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'x'")
    rt.redis.client.delete(rt.redis.keys.deferrals("b", "capacity"))  # as the end of its job clears them
    gate.gate_pass(rt.ports, "b")
    assert states(rt, "b")[("ch1", "s3", "audio")] == "generating"
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"


def test_an_interactive_pair_at_its_book_cap_does_not_put_the_books_bulk_pairs_first(rt) -> None:
    """The book waited at the most urgent priority of every pair refused, those its hard cap refused (which do not
    wait for the lane) among them: a reader's scene at the cap put the book's bulk pairs ahead of the books that
    waited at normal priority, and each freed slot went to that bulk work first."""
    from animastor_tasks.domain.deferral import wait_score
    from animastor_tasks.domain.vocabulary import DeferralBucket, Priority, priority_rank

    lane(rt, lane_limit=2, book_quota=2, window=4, book_cap=1)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority="bulk")
    assert [s for (_, s, _), v in states(rt, "b").items() if v == "generating"] == ["s1"]  # its cap
    rt.ports.deferrals.wait_for_lane("gpu.audio", "n", wait_score(priority_rank(Priority.NORMAL), 100.0))
    rt.redis.client.delete(rt.redis.keys.deferrals("b", DeferralBucket.CAPACITY))  # their deferrals ran out
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s2"]], priority="interactive")
    assert states(rt, "b")[("ch1", "s2", "audio")] == "pending"  # refused by the cap
    # Its bulk pair waits at bulk priority (the slot went to the normal book), not at its cap-refused scene's.
    assert waiting(rt)["b"] >= wait_score(priority_rank(Priority.BULK), 0.0)


def test_a_reader_handed_a_slot_keeps_it_from_a_bulk_pass_made_before_its_refill_ran(one_slot, monkeypatch) -> None:
    """A hand-over takes the book off the waiting list and sends its refill: a bulk book's pass run before that
    refill (its regenerate, on the other control process) saw a free slot and nobody waiting, and took it; the
    reader's scene was refused `lane_full` and waited a whole bulk job more."""
    from animastor_tasks.flow import lanes, refill

    from .test_elastic_share import finish_one, run_control, running

    rt = one_slot
    for book, scenes in (("first", 1), ("reader", 1), ("bulk", 2)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "first", ["audio"])  # takes the only slot
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], priority="interactive")  # waits for the lane
    with monkeypatch.context() as lost:  # its own refill runs nowhere: the hand-over below is the slot's
        lost.setattr(refill, "free_slot", lambda *_a, **_k: None)
        finish_one(rt, "first")
    assert lanes.hand_over(rt.ports, "gpu.audio", 1) == ["reader"]  # its refill waits on the control queue
    regenerate_flow.regenerate(rt.ports, "bulk", ["audio"], priority="bulk")  # a pass before that refill
    run_control(rt)
    assert running(rt, "reader", "bulk") == {"reader": 1}
