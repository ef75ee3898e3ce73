"""A book handed a slot while its own job's end refills it: the two refills race. The handed one found its pair claimed
by the other; its pass had read the lane's waiting list before (nobody else on it) and so handed nothing on, and the
refill took the lane for used, as its claim had counted it: the slot idled beside a waiting book until the tick's
stranded check saw it twice (5-10 s)."""

from __future__ import annotations

from typing import Any

import pytest

from animastor_tasks.flow import refill as refill_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.page import PassReport
from animastor_tasks.worker.wiring import Wiring

from .helpers import end_job, make_book
from .test_elastic_share import lane, run_control, running, waiting


def test_a_handed_refill_whose_pair_its_own_book_claimed_hands_the_slot_on(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch
) -> None:
    lane(rt, lane_limit=3, book_quota=10, window=10)
    for book, scenes in (("c", 1), ("a", 3), ("b", 5)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert running(rt, "a", "b", "c") == {"a": 2, "c": 1} and list(waiting(rt)) == ["b", "a"]

    # Three jobs end at once on three GPUs: each process's hand-over step runs, their refills are held.
    held: list[tuple[Any, ...]] = []
    real = refill_flow.refill
    monkeypatch.setattr(refill_flow, "refill", lambda *a, **k: held.append((a, k)) or PassReport(a[1]))
    end_job(rt, "a", "s1")  # the slot goes to b, the head; a queues behind it
    end_job(rt, "c", "s1")  # c has nothing left: the slot goes to a
    end_job(rt, "a", "s2")  # nobody else waits: a's own refill
    monkeypatch.undo()
    (to_b, to_b_kw), (a_handed, a_handed_kw), (a_own, a_own_kw) = held
    assert (to_b[1], a_handed[1], a_own[1]) == ("b", "a", "a")

    # a's handed refill reads its snapshot (nobody but a on the list), then b's and a's own refills run to their end.
    snapshot = rt.ports.book_state.pair_snapshot

    def read_then_the_others(*args: Any, **kwargs: Any) -> Any:
        read = snapshot(*args, **kwargs)
        if held:
            held.clear()
            real(*to_b, **to_b_kw)
            real(*a_own, **a_own_kw)
        return read

    monkeypatch.setattr(rt.ports.book_state, "pair_snapshot", read_then_the_others)
    real(*a_handed, **a_handed_kw)
    monkeypatch.undo()
    run_control(rt)
    # b has three scenes pending: the third slot is b's, not idle until the tick.
    assert running(rt, "a", "b", "c") == {"b": 2, "a": 1}


def test_a_handed_refill_hands_on_no_slot_another_books_refill_is_on_its_way_to(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handed refill's spare slots of its lane are counted less those handed since its read (their refills are on
    their way): counted free, b's slot went to c, the next on the list, and b's refill found the lane full."""
    lane(rt, lane_limit=2, book_quota=10, window=10)
    rt.catalog.import_book(make_book("x", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])
    for book in ("a", "b", "c"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert running(rt, "x") == {"x": 2} and list(waiting(rt)) == ["a", "b", "c"]
    held: list[tuple[Any, ...]] = []
    real = refill_flow.refill
    monkeypatch.setattr(refill_flow, "refill", lambda *a, **k: held.append((a, k)) or PassReport(a[1]))
    end_job(rt, "x", "s1")  # the slot goes to a
    assert [(args[1], args[2] if len(args) > 2 else None) for args, _ in held] == [("a", "gpu.audio")]
    held.clear()
    snapshot = rt.ports.book_state.pair_snapshot

    def read_then_the_next_end(*args: Any, **kwargs: Any) -> Any:
        read = snapshot(*args, **kwargs)
        if not held:
            end_job(rt, "x", "s2")  # the second slot goes to b: its refill is on its way
        return read

    monkeypatch.setattr(rt.ports.book_state, "pair_snapshot", read_then_the_next_end)
    real(rt.ports, "a", "gpu.audio")  # as the control worker runs a refill handed one slot (animastor.refill)
    monkeypatch.undo()
    [(to_b, to_b_kw)] = held
    run_control(rt)
    real(*to_b, **to_b_kw)
    assert running(rt, "a", "b", "c") == {"a": 1, "b": 1}
