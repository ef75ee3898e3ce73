"""A handed refill's hand-over note holds its slot only until the refill's claim counts it: the note goes in the
claim's own Redis batch, before the claim's COMMIT, and a pass's hand-on of its unused slots reads the notes again
after its claim, not at its snapshot. *Why:* the note lived on until the refill had published its jobs, and its
claimed slot was subtracted twice, once in the lane's count and once as held: a count of the lanes
(`lanes.hand_on_freed`) or a handed book refused by its cap handed nothing on, and a genuinely free slot idled beside
a waiting book until the tick found it stranded (5-10 s)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from animastor_tasks.domain.deferral import RANK_SCALE, wait_score
from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.domain.vocabulary import Priority, priority_rank
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import lanes, publish
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.app import app
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book, states
from .test_elastic_share import lane, run_control, running, waiting

LANE = "gpu.audio"


def _ends_unseen(rt: Wiring, book: str) -> None:
    """The book's running job ends and nothing hands its slot on (its job's end looked at the list before the
    waiting books joined it, or its hand-on was lost): the slot is free, and only a count of the lanes sees it."""
    with rt.db.transaction() as conn:
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = %s AND state = 'generating'", (book,))


def _refills(rt: Wiring) -> dict[str, Callable[[], object]]:
    """The refill messages waiting in the broker, taken off it: per book, a call that runs it through the task."""
    client = redis.Redis.from_url(rt.settings.broker_url)
    found: dict[str, Callable[[], object]] = {}
    try:
        while (raw := client.rpop(CONTROL_QUEUE)) is not None:
            message = json.loads(raw)
            _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            task = app.tasks[message["headers"]["task"]]
            found[kwargs["book_id"]] = lambda task=task, kwargs=kwargs: task.run(**kwargs)
    finally:
        client.close()
    return found


def _before_publish(monkeypatch: pytest.MonkeyPatch, book: str, step: Callable[[], object]) -> None:
    """`step` runs once, as `book`'s pass publishes its claimed jobs: its claim is committed (counted), and its
    refill has not reported back yet."""
    real = publish.publish_claims

    def publishing(ports: Any, of: str, *args: Any, **kwargs: Any) -> Any:
        if of == book:
            monkeypatch.setattr(publish, "publish_claims", real)
            step()
        return real(ports, of, *args, **kwargs)

    monkeypatch.setattr(publish, "publish_claims", publishing)


def test_a_count_of_the_lanes_while_a_handed_refill_publishes_hands_the_other_free_slot_on(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`a` is handed one of the lane's slots and claims it; as it publishes, another job ends unseen and a count of
    the lanes follows. Old code: `a`'s claimed slot counted as held too, the free slot was not handed on
    (running `a`, `z` only, w waiting)."""
    lane(rt, lane_limit=3, book_quota=10, window=10)
    for book, scenes in (("x", 1), ("y", 1), ("z", 1), ("a", 1), ("w", 2)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    for book in ("x", "y", "z", "a", "w"):
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert running(rt, "x", "y", "z") == {"x": 1, "y": 1, "z": 1}
    assert list(waiting(rt)) == ["a", "w"]
    _ends_unseen(rt, "x")
    assert lanes.hand_over(rt.ports, LANE, 1) == ["a"]
    refill_a = _refills(rt)["a"]

    def y_ends_and_the_lanes_are_counted() -> None:
        _ends_unseen(rt, "y")
        lanes.hand_on_freed(rt.ports, {LANE})

    _before_publish(monkeypatch, "a", y_ends_and_the_lanes_are_counted)
    refill_a()
    run_control(rt)
    assert running(rt, "z", "a", "w") == {"z": 1, "a": 1, "w": 1}, (running(rt, "z", "a", "w"), waiting(rt))


@pytest.mark.parametrize("when", ["between d's snapshot and its claim", "while a publishes"])
def test_a_handed_book_its_cap_refuses_hands_its_slot_on_beside_a_refill_that_claimed(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """`d` and `a` are each handed one of two free slots. `d`, at its cap, hands its slot on as spare; `a`'s refill
    claims the other at a moment `d`'s pass reads its note (before d's claim, or while a publishes). Old code: `a`
    counted twice, `d` handed nothing on, and w waited beside the free slot."""
    lane(rt, lane_limit=3, book_quota=10, window=10, book_cap=1)
    for book, scenes in (("x", 1), ("y", 1), ("d", 3), ("a", 1), ("w", 2)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    for book in ("x", "y", "d", "a", "w"):
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert running(rt, "x", "y", "d") == {"x": 1, "y": 1, "d": 1}
    rt.ports.deferrals.wait_for_lane(LANE, "d", wait_score(priority_rank(Priority.NORMAL), 1.0))  # waited longest
    assert list(waiting(rt)) == ["d", "a", "w"]
    _ends_unseen(rt, "x")
    _ends_unseen(rt, "y")
    assert lanes.hand_over(rt.ports, LANE, 1) == ["d"]
    assert lanes.hand_over(rt.ports, LANE, 1) == ["a"]
    refills = _refills(rt)
    if when == "while a publishes":
        _before_publish(monkeypatch, "a", refills["d"])
        refills["a"]()
    else:
        real = rt.ports.assets.claiming

        def claiming(book: str, *args: Any, **kwargs: Any) -> Any:
            if book == "d":
                monkeypatch.setattr(rt.ports.assets, "claiming", real)
                refills["a"]()
            return real(book, *args, **kwargs)

        monkeypatch.setattr(rt.ports.assets, "claiming", claiming)
        refills["d"]()
    run_control(rt)
    assert running(rt, "d", "a", "w") == {"d": 1, "a": 1, "w": 1}, (running(rt, "d", "a", "w"), waiting(rt))


@pytest.mark.parametrize("priority", [Priority.INTERACTIVE, Priority.BULK])
def test_a_handed_claim_that_fails_after_its_redis_batch_keeps_the_book_s_place_at_its_priority(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch, priority: Priority
) -> None:
    """The note went with the claim's Redis batch, and then the claim did not commit (Postgres failing over): the
    book keeps its place at the head of the priority it was handed the slot at, not of `normal` (the default of a
    book whose note is gone: a bulk book went ahead of every normal one), and its pair waits, pending."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    for book in ("x", "b", "w"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority=priority)
    if priority == Priority.INTERACTIVE:
        regenerate_flow.regenerate(rt.ports, "w", ["audio"])  # a normal book waits behind it
    _ends_unseen(rt, "x")
    assert lanes.hand_over(rt.ports, LANE, 1) == ["b"]
    refill_b = _refills(rt)["b"]
    real = rt.ports.leases.batched

    @contextmanager
    def batch_then_commit_fails() -> Iterator[None]:
        monkeypatch.setattr(rt.ports.leases, "batched", real)
        with real():
            yield
        raise StoreUnavailable("postgres", "postgresql://db", "the COMMIT was refused")

    monkeypatch.setattr(rt.ports.leases, "batched", batch_then_commit_fails)
    assert refill_b()["error"]
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"
    assert waiting(rt)["b"] // RANK_SCALE == priority_rank(priority)
    assert not rt.redis.client.hexists(rt.redis.keys.lane_handed(LANE), "b")
