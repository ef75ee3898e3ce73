"""A lane whose breaker closes again is refilled at once, not on the next tick.

Real Postgres, Redis and broker; jobs run in-process, control messages through the real tasks
(`test_elastic_share`'s helpers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from animastor_tasks.domain.deferral import wait_score
from animastor_tasks.domain.vocabulary import Priority, priority_rank
from animastor_tasks.errors import GeneratorError, StoreUnavailable
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, lanes
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.records import Committed

from .helpers import Pauses, advertise, make_book, states, use_settings
from .test_elastic_share import finish_one, lane, run_control, running
from .test_generate import dispatched_jobs, with_stage
from .test_job_troubles import _Scripted, _use_generator


def test_a_breaker_closed_by_a_job_that_ran_well_sends_the_passes_that_waited_for_it_at_once(rt) -> None:
    """While the breaker was open the book's pairs waited for it, passed by each tick; the job whose success closed
    it freed its own slot only, and the lane's other free slots stood idle until the next tick (up to 5 s)."""
    lane(rt, lane_limit=4, book_quota=4, window=4)
    use_settings(rt, replace(rt.settings, breaker_threshold=1, breaker_cooldown_seconds=60))
    rt.catalog.import_book(make_book("a", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("w", chapters=1, scenes=4))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    assert rt.ports.breaker.breaker_record_run("gpu.audio", False, 1, 60, None).state == "open"  # another job's failure
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])
    assert set(states(rt, "w").values()) == {"pending"}
    assert rt.redis.client.zscore(rt.redis.keys.due(), "w") is not None  # passed again by each tick
    run_control(rt)
    finish_one(rt, "a")  # runs well: the breaker closes
    assert rt.breaker.breaker_state("gpu.audio") == "closed"
    assert running(rt, "w") == {"w": 4}


def test_a_breaker_closed_by_a_test_publish_lets_its_books_other_pairs_go_at_once(rt, monkeypatch) -> None:
    """A broker outage opened the breaker; the half-open pass's one test publish closed it, and the book's other
    pairs, behind that permit, waited for the next tick."""
    lane(rt, lane_limit=4, book_quota=4, window=4)
    use_settings(rt, replace(rt.settings, breaker_threshold=1, breaker_cooldown_seconds=0.01))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=4))
    rt.ports.breaker.breaker_record("gpu.audio", False, 1, 0.01)  # a publish failed: open for 10 ms
    time.sleep(0.05)
    report = regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # half-open by now: one test publish
    assert report["commands"][0]["status"] == "active"
    assert rt.breaker.breaker_state("gpu.audio") == "closed"
    run_control(rt)
    assert running(rt, "b") == {"b": 4}


def test_passes_that_cannot_be_sent_when_a_breaker_closes_cost_the_pass_that_closed_it_nothing(rt, monkeypatch) -> None:
    """Sending the due books' passes is an extra: a broker refusing it (it just took the test job) must not fail
    the pass whose publish closed the breaker, nor leave its claims half done."""
    lane(rt, lane_limit=4, book_quota=4, window=4)
    use_settings(rt, replace(rt.settings, breaker_threshold=1, breaker_cooldown_seconds=0.01))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=4))
    rt.ports.breaker.breaker_record("gpu.audio", False, 1, 0.01)
    time.sleep(0.05)

    def refused(book_ids):  # type: ignore[no-untyped-def]
        raise ConnectionError("broker refused")

    monkeypatch.setattr(rt.ports.publisher, "enqueue_gates", refused)
    report = regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert report["commands"][0]["status"] == "active"
    assert rt.breaker.breaker_state("gpu.audio") == "closed"
    assert running(rt, "b") == {"b": 1}  # the test job; the book's other pairs go with its next pass
    assert rt.redis.client.zscore(rt.redis.keys.due(), "b") is not None


def _waiting(rt, queue: str) -> list[str]:  # type: ignore[no-untyped-def]
    return [str(b) for b in rt.redis.client.zrange(rt.redis.keys.lane_waiters(queue), 0, -1)]


def test_a_half_open_lane_hands_its_one_test_permit_to_one_waiting_book_and_keeps_the_others_in_line(rt) -> None:
    """Past the cooldown with no test permit out, a hand-over of the lane's free slots took every waiting book off
    its list: one got the permit, each other was refused by the breaker, passed its slot on and was off the list
    for good, its place in line lost (back only when its own deferral ran out)."""
    queue = "gpu.audio"
    for i, book in enumerate(("a", "b", "c")):
        rt.ports.deferrals.wait_for_lane(queue, book, 100.0 + i)
    now = rt.redis.server_time()
    rt.redis.client.hset(rt.redis.keys.breaker(queue), mapping={"failures": 5, "open_until": repr(now - 1)})
    assert rt.ports.deferrals.next_waiters(queue, 3) == ["a"]  # the one the test permit is for
    assert _waiting(rt, queue) == ["b", "c"]
    rt.redis.client.hset(rt.redis.keys.breaker(queue), "permit_until", repr(now + 60))  # the permit is out
    assert rt.ports.deferrals.next_waiters(queue, 3) == []
    assert _waiting(rt, queue) == ["b", "c"]


def test_a_job_ending_while_its_lane_is_open_keeps_its_book_in_line_behind_the_waiters(rt) -> None:
    """With the breaker open, a job's end took its own book off the waiting list as though nobody else waited
    (and noted it served): each job that failed into an outage cost its book its place in line."""
    queue = "gpu.audio"
    for i, book in enumerate(("a", "b")):
        rt.ports.deferrals.wait_for_lane(queue, book, 100.0 + i)
    rt.redis.client.hset(rt.redis.keys.breaker(queue), mapping={"open_until": repr(rt.redis.server_time() + 60)})
    ended = ("d-x", Committed(priority_rank(Priority.NORMAL)))  # x's job left it normal work
    assert rt.ports.deferrals.next_waiters(queue, 1, exclude="x", ended=ended) == []
    assert _waiting(rt, queue) == ["a", "b", "x"]
    assert rt.redis.client.hgetall(rt.redis.keys.lane_handed(queue)) == {}


def test_a_reader_s_scene_that_waited_for_an_open_breaker_goes_before_a_bulk_book_when_it_closes(rt) -> None:
    """Pairs refused by an open breaker left their books off the lane's waiting list, only due: the passes sent as
    the breaker closed went in due order, and a bulk book regenerated before the reader's scene took every free
    slot; the scene waited a whole bulk job."""
    lane(rt, lane_limit=2, book_quota=2, window=4)
    use_settings(rt, replace(rt.settings, breaker_threshold=1, breaker_cooldown_seconds=60))
    for book, scenes in (("a", 1), ("bulk", 4), ("reader", 1)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    assert rt.ports.breaker.breaker_record_run("gpu.audio", False, 1, 60, None).state == "open"  # another job's failure
    regenerate_flow.regenerate(rt.ports, "bulk", ["audio"], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "reader", ["audio"], priority="interactive")
    run_control(rt)
    assert running(rt, "bulk", "reader") == {}
    finish_one(rt, "a")  # runs well: the breaker closes
    assert rt.breaker.breaker_state("gpu.audio") == "closed"
    assert running(rt, "bulk", "reader") == {"reader": 1, "bulk": 1}


def test_a_breaker_that_closes_hands_its_free_slots_to_the_books_waiting_for_the_lane(rt) -> None:
    """A book waiting for the lane (its pairs deferred for capacity) is not passed by the due passes the closing
    sent: the lane's free slots stood beside it until the tick found them stranded, two ticks later."""
    queue = "gpu.audio"
    lane(rt, lane_limit=3, book_quota=1, window=4)
    rt.catalog.import_book(make_book("first", chapters=1, scenes=3))
    rt.catalog.import_book(make_book("waiter", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "first", ["audio"])
    regenerate_flow.regenerate(rt.ports, "waiter", ["audio"])
    assert running(rt, "first", "waiter") == {"first": 3}
    assert _waiting(rt, queue) == ["waiter"]
    rt.redis.client.hset(rt.redis.keys.breaker(queue), mapping={"open_until": repr(rt.redis.server_time() + 60)})
    cancel_flow.cancel(rt.ports, "first")  # three slots free, but the lane is open: nobody is handed one
    run_control(rt)
    assert running(rt, "first", "waiter") == {} and _waiting(rt, queue) == ["waiter"]
    rt.redis.client.delete(rt.redis.keys.breaker(queue))
    lanes.breaker_closed(rt.ports, queue)
    run_control(rt)
    assert running(rt, "waiter") == {"waiter": 2}


def test_a_test_publish_that_closes_the_breaker_hands_each_free_slot_once(rt) -> None:
    """The closing publish's own pass hands its spare slots on; the breaker's closing handed the same free slots
    again, each to a second book, which found the lane full and went to the head of its priority."""
    queue = "gpu.audio"
    lane(rt, lane_limit=4, book_quota=4, window=4)
    use_settings(rt, replace(rt.settings, breaker_threshold=1, breaker_cooldown_seconds=0.01))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=4))
    for i, waiter in enumerate(("w1", "w2", "w3", "w4")):  # bulk books: b's normal pairs go before them
        rt.ports.deferrals.wait_for_lane(queue, waiter, wait_score(priority_rank(Priority.BULK), 100.0 + i))
    rt.ports.breaker.breaker_record(queue, False, 1, 0.01)
    time.sleep(0.05)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # half-open: its one test publish closes the breaker
    assert rt.breaker.breaker_state(queue) == "closed"
    assert _waiting(rt, queue) == ["w4"]  # three free slots, three books handed one each


def test_a_breaker_whose_free_slots_cannot_be_handed_on_still_sends_the_due_passes(rt, monkeypatch) -> None:
    """Handing the slots on is an extra of the job whose success closed the breaker: a broker refusing the refill
    message raised out of the job's end."""
    queue = "gpu.audio"
    lane(rt, lane_limit=2)
    rt.ports.deferrals.wait_for_lane(queue, "w", 100.0)
    rt.ports.book_state.set_due("d", 0.0)

    def refused(*_a: object, **_k: object) -> None:
        raise StoreUnavailable("broker", rt.settings.broker_url, "connection refused")

    monkeypatch.setattr(rt.ports.publisher, "enqueue_refill", refused)
    lanes.breaker_closed(rt.ports, queue)
    assert rt.redis.client.zscore(rt.redis.keys.due(), "d") is None  # its pass was sent


COOLDOWN = 0.5


def _one_bad_scene(
    rt: Any, tmp_path: Any, *, book_cap: int, retries: int, error: Callable[[], Exception]
) -> list[bool]:
    """Book `b` of 6 scenes regenerated on a stage (breaker threshold 2, a cool-down of `COOLDOWN`) whose server
    answers `error()` to every scene while the flag returned holds, and to s1 always."""
    spec = replace(rt.settings.registry.get("audio"), book_cap=book_cap)
    settings = {"breaker_threshold": 2, "breaker_cooldown_seconds": COOLDOWN, "generate_max_retries": retries}
    with_stage(rt, spec, tmp_path, retry_backoff_base=0.01, retry_backoff_max=0.02, **settings)
    down = [True]

    def answer(request, _progress) -> None:
        if down[0] or request.scene_id == "s1":
            raise error()

    _use_generator(rt, _Scripted(answer))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    return down


def _cool_downs(rt: Any, host: Pauses, rounds: int, done: Callable[[], bool]) -> None:
    """Up to `rounds` cool-downs, each followed by the book's pass (as a tick's) and its jobs, until `done()`."""
    for _ in range(rounds):
        time.sleep(COOLDOWN + 0.1)
        rt.redis.client.delete(rt.redis.keys.deferrals("b", "capacity"))  # the passes a tick would make meanwhile
        gate.gate_pass(rt.ports, "b")
        for job in dispatched_jobs(rt, "b"):
            run_job(rt.ports, job, worker="t", later=host)
        if done():
            return


def _audio(rt: Any) -> dict[str, str]:
    return {scene: state for (_, scene, stage), state in states(rt, "b").items() if stage == "audio"}


def test_a_scene_the_backend_always_fails_is_not_the_half_open_test_for_ever(rt, tmp_path) -> None:
    """A scene whose text makes the server answer 500 every time, given back as the breaker opened, was the first
    pending pair in reading order at every half-open test: it failed, reopened the breaker and went back, cool-down
    after cool-down, and the book's healthy scenes never ran (0 ready after 6 cool-downs)."""
    error = "stage 'audio': inference endpoint answered 500: Internal Server Error"
    outage = _one_bad_scene(rt, tmp_path, book_cap=4, retries=1, error=lambda: GeneratorError(error))
    # The server restarts while the book's four jobs run; they end last first: s4 fails (the breaker still closed),
    # s3 opens it and goes back, s2 and s1 go back with it open.
    host = Pauses()  # its pauses are the worker's (worker/chain.py): this loop waits out the cool-downs itself
    for job in reversed(dispatched_jobs(rt, "b")):
        run_job(rt.ports, job, worker="t", later=host)
    outage[0] = False  # back, but s1's text still makes it fail
    _cool_downs(rt, host, 8, lambda: not {"pending", "generating"} & set(_audio(rt).values()))
    assert _audio(rt) == {"s1": "failed", "s2": "ready", "s3": "ready", "s4": "failed", "s5": "ready", "s6": "ready"}


def test_a_scene_the_backend_always_rate_limits_is_not_the_half_open_test_for_ever(rt, tmp_path) -> None:
    """A scene the server answers 429 every time (a limit that depends on the input) was given back without a
    deferral, whatever the breaker said: the first pending pair in reading order, it took every half-open test, and
    the book's healthy scenes waited cool-down after cool-down (0 of 5 ready after 8 of them). Deferred past the next
    test, it comes back once a test passed (the breaker clean), and reopens it: the healthy scenes go in between."""
    error = "stage 'audio': inference endpoint answered 429: slow down"
    limited = _one_bad_scene(
        rt, tmp_path, book_cap=1, retries=0, error=lambda: GeneratorError(error, rate_limited=True)
    )
    host = Pauses()
    for _ in range(2):  # s1 twice: the breaker opens
        for job in dispatched_jobs(rt, "b"):
            run_job(rt.ports, job, worker="t", later=host)
        rt.redis.client.delete(rt.redis.keys.deferrals("b", "capacity"))
        gate.gate_pass(rt.ports, "b")
    limited[0] = False  # the limit lifts, but not for s1's text
    healthy = dict.fromkeys(("s2", "s3", "s4", "s5", "s6"), "ready")
    _cool_downs(rt, host, 24, lambda: {s: v for s, v in _audio(rt).items() if s != "s1"} == healthy)
    got = _audio(rt)
    assert {s: v for s, v in got.items() if s != "s1"} == healthy, got
    assert got["s1"] in ("pending", "generating")  # a rate limit is no verdict on the scene: it is never failed
