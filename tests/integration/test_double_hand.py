"""A slot handed moments ago, its refill on its way (a live hand-over record), is not free: a count of the lanes
(`lanes.hand_on_freed`) and a pass's hand-on of its spare slots leave it to that refill, and a handed book refused
because a more urgent book holds the slot waits at its own place, not at the head of its priority. *Why:* handed
again, the slot went to a normal book whose refill the hold refused; back at the head of its priority it handed the
"spare" slot on, and two books' refills bounced it between them (40 refills in 0.1 s) until the first one ran."""

from __future__ import annotations

import base64
import json

import pytest
import redis

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.flow import lanes, refill
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.app import app
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book, states
from .test_elastic_share import finish_one, lane, run_control, running, waiting


@pytest.fixture
def handed(rt: Wiring, monkeypatch: pytest.MonkeyPatch) -> Wiring:
    """One slot, freed with nobody handed it, then handed to the interactive `reader`, whose refill is on its way;
    normal books w2 then w3 wait for the lane."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    for book in ("first", "reader", "w2", "w3"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "first", ["audio"], [["ch1", "s1"]])  # the only slot
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], priority="interactive")
    regenerate_flow.regenerate(rt.ports, "w2", ["audio"])
    regenerate_flow.regenerate(rt.ports, "w3", ["audio"])
    with monkeypatch.context() as m:
        m.setattr(refill, "free_slot", lambda *_a, **_k: None)
        finish_one(rt, "first")
    assert lanes.hand_over(rt.ports, "gpu.audio", 1) == ["reader"]
    assert list(waiting(rt)) == ["w2", "w3"]
    return rt


def _run_all_but_reader(rt: Wiring, most: int = 40) -> tuple[list[str], list[bytes]]:
    """The control messages, oldest first, the reader's refill held back (a busy control queue): the books whose
    refills ran, and the reader's messages."""
    client = redis.Redis.from_url(rt.settings.broker_url)
    held: list[bytes] = []
    ran: list[str] = []
    try:
        while len(ran) < most and (raw := client.rpop(CONTROL_QUEUE)) is not None:
            message = json.loads(raw)
            _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            if kwargs.get("book_id") == "reader":
                held.append(raw)
                continue
            app.tasks[message["headers"]["task"]].run(**kwargs)
            ran.append(kwargs["book_id"])
    finally:
        client.close()
    return ran, held


def _reader_s_refill_runs(rt: Wiring, held: list[bytes]) -> None:
    for raw in held:
        message = json.loads(raw)
        _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        app.tasks[message["headers"]["task"]].run(**kwargs)
    run_control(rt)


def test_a_count_of_the_lanes_leaves_a_slot_handed_moments_ago_to_its_refill(handed: Wiring) -> None:
    """Old code: `hand_on_freed` handed the slot to w2 too, and w2 and w3 bounced it (`len(ran) >= 10`)."""
    rt = handed
    lanes.hand_on_freed(rt.ports, {"gpu.audio"})  # a tick batch ends, say
    ran, held = _run_all_but_reader(rt)
    assert ran == []
    assert list(waiting(rt)) == ["w2", "w3"]  # nobody lost its place
    _reader_s_refill_runs(rt, held)
    assert running(rt, "reader", "w2", "w3") == {"reader": 1}


def test_a_handed_book_refused_for_a_more_urgent_one_s_slot_keeps_no_head_place_and_hands_nothing_on(
    handed: Wiring,
) -> None:
    """The same slot handed to w2 by a count that did not see the reader's hand-over (the tick's stranded check):
    w2's refill is refused by the reader's hold. Old code: w2 went back at the head of its priority, ahead of w3
    that had waited longer, and handed the 'spare' slot on to w3, whose refill did the same (`ran` w2, w3, w2...)."""
    rt = handed
    assert lanes.hand_over(rt.ports, "gpu.audio", 1) == ["w2"]
    ran, held = _run_all_but_reader(rt)
    assert ran == ["w2"]
    assert list(waiting(rt)) == ["w3", "w2"]  # w2 waits behind the book that waited longer at its priority
    assert states(rt, "w2")[("ch1", "s1", "audio")] == "pending"
    _reader_s_refill_runs(rt, held)
    assert running(rt, "reader", "w2", "w3") == {"reader": 1}


def test_a_pass_does_not_hand_on_a_slot_handed_moments_ago(handed: Wiring) -> None:
    """A new book's pass, refused by the reader's hold, counted the handed slot as its spare one and handed it to
    w2 (old code: `ran` w2, w3, w2, ...)."""
    rt = handed
    rt.catalog.import_book(make_book("n", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "n", ["audio"])
    assert states(rt, "n")[("ch1", "s1", "audio")] == "pending"
    ran, held = _run_all_but_reader(rt)
    assert ran == []
    assert list(waiting(rt)) == ["w2", "w3", "n"]
    _reader_s_refill_runs(rt, held)
    assert running(rt, "reader", "w2", "w3", "n") == {"reader": 1}
