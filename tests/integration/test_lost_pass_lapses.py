"""What the tick does with lost passes beyond sending them again: a pass that stalls gives the books after it to the
tick; books lost once go in the usual batches, twice each alone, three times not at all (reconcile's round).

Real Postgres, Redis and broker, as in test_lost_gate_batch.py (its helpers).
"""

from __future__ import annotations

import base64
import json
import threading
import time

import pytest
import redis

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import gate, pass_hold
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book
from .test_due_index_lost import BOOKS, generating, tick
from .test_elastic_share import lane, run_control
from .test_lost_gate_batch import (
    HOLD,
    WorkerDied,
    dies_at,
    held,
    lost_passes,
    refuses_once,
    short_hold,
    workers_back,
)

__all__ = ["short_hold"]  # the fixture, used by name


def queued_batches(rt: Wiring) -> list[list[str]]:
    """The books of each gate batch waiting in the control queue, oldest first."""
    client = redis.Redis.from_url(rt.settings.broker_url)
    try:
        raw = client.lrange(CONTROL_QUEUE, 0, -1)
    finally:
        client.close()
    batches = []
    for message in reversed(raw):
        body = json.loads(message)
        if body["headers"]["task"] == "animastor.gate_batch":
            _, kwargs, _ = json.loads(base64.b64decode(body["body"]))
            batches.append(kwargs["book_ids"])
    return batches


def test_a_stalled_pass_gives_the_books_after_it_to_the_tick(rt: Wiring, monkeypatch, short_hold) -> None:
    """Renewed for as long as one pass hung, the books after it in the batch never got theirs; let lapse whole, the
    book being passed was passed twice at once and counted lost, again every 80 s while its passes stayed slow."""
    monkeypatch.setattr(pass_hold, "STALL_SECONDS", 2 * HOLD)
    workers_back(rt)
    tick(rt)
    real, ticks, passes = gate.gate_pass, [], []

    def hangs(ports, name, **kwargs):  # type: ignore[no-untyped-def]
        passes.append(name)
        if name == "b04" and not ticks:
            time.sleep(4 * HOLD)
            ticks.append(tick(rt))
        return real(ports, name, **kwargs)

    monkeypatch.setattr(gate, "gate_pass", hangs)
    run_control(rt)  # the batch, then the one the tick sent meanwhile
    assert sorted(ticks[0]) == BOOKS[5:]  # given to the tick; b04, its pass alive, stays held
    assert sorted(passes) == BOOKS  # each passed once: the stalled batch skipped those it gave away
    assert lost_passes(rt) is None and held(rt) == [] and all(generating(rt, b) for b in BOOKS)


def test_an_outage_sends_its_lost_passes_in_the_usual_batches(rt: Wiring, short_hold) -> None:
    """Each alone, 200 books lost with 4 killed control processes were 200 messages in one tick, not 4."""
    books = [f"x{i:03d}" for i in range(120)]
    for first in range(0, 120, 40):
        pass_hold.PassHold(rt.ports, books[first : first + 40]).abandon()
    time.sleep(HOLD + 0.1)
    assert sorted(tick(rt)) == books
    assert [len(b) for b in queued_batches(rt)] == [50, 50, 20]


def killing(rt: Wiring, monkeypatch: pytest.MonkeyPatch, book: str) -> None:
    """Run the control queue with `book`'s pass killing its process: each death stops a run, the messages behind
    it run on a successor."""
    with monkeypatch.context() as dying:
        dies_at(dying, book)
        while True:
            try:
                run_control(rt)
                return
            except WorkerDied:
                continue


def lapses(rt: Wiring) -> dict[str, str]:
    return rt.redis.client.hgetall(rt.redis.keys.held_pass_lapses())


def test_a_book_whose_pass_kills_its_process_is_given_up(rt: Wiring, monkeypatch, short_hold, caplog) -> None:
    """Never given up, it was sent alone every 25 s for ever, killing a control process each time; forgotten when
    given up, reconcile's round brought it back counted from 1, in a batch with other books."""
    workers_back(rt)
    tick(rt)
    sent = []
    for _ in range(3):
        killing(rt, monkeypatch, "b04")
        time.sleep(HOLD + 0.1)
        tick(rt)
        sent.append(queued_batches(rt))
    assert sent[0] == [BOOKS]  # lost once: one batch (those passed in the last renewal's time among them)
    assert sorted(sent[1]) == [[b] for b in BOOKS]  # twice: each alone
    assert sent[2] == []  # b04 three times: given up; the others passed alone and were forgotten
    assert "book='b04' 3 times: pass lost with its control process" in caplog.text
    assert lapses(rt) == {"b04": "3"}
    rt.counters.flush()
    assert rt.redis.client.hget(rt.redis.keys.metrics(), "lost_pass_given_up") == "1"
    run_control(rt)
    assert all(generating(rt, b) for b in BOOKS if b != "b04")
    rt.ports.book_state.set_due("b04", 0)  # reconcile's round, a regenerate: sent, and alone
    tick(rt)
    assert queued_batches(rt) == [["b04"]]


def test_an_error_is_no_pass_and_forgets_no_lost_one(rt: Wiring, monkeypatch, short_hold) -> None:
    """A batch that raised let go of every book's count, those it never passed among them: a book whose pass kills
    its process started again from 1."""
    workers_back(rt)
    tick(rt)
    rt.redis.client.hset(rt.redis.keys.held_pass_lapses(), "b04", 2)  # lost twice before this batch
    real = gate.gate_pass

    def broken(ports, name, **kwargs):  # type: ignore[no-untyped-def]
        if name == "b01":
            raise RuntimeError("a bug in a pass")
        return real(ports, name, **kwargs)

    with monkeypatch.context() as failing, pytest.raises(RuntimeError):
        failing.setattr(gate, "gate_pass", broken)
        run_control(rt)
    assert held(rt) == [] and lapses(rt) == {"b04": "2"}


def give_away_refused(rt: Wiring, monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    """Every book due and its batch sent, a pass stalled after 2 holds to give the books after it away, and the
    first due write of them refused (that write's arguments, once made)."""
    monkeypatch.setattr(pass_hold, "STALL_SECONDS", 2 * HOLD)
    workers_back(rt)
    tick(rt)
    return refuses_once(rt, monkeypatch, "set_due_all")


def test_a_give_away_whose_due_write_failed_is_tried_again(rt: Wiring, monkeypatch, short_hold) -> None:
    """The books after a stalled pass were let go all the same: not due, not held, never passed until reconcile."""
    real_pass, failed = gate.gate_pass, give_away_refused(rt, monkeypatch)

    def hangs(ports, name, **kwargs):  # type: ignore[no-untyped-def]
        if name == "b04" and not failed:
            time.sleep(4 * HOLD)
        return real_pass(ports, name, **kwargs)

    monkeypatch.setattr(gate, "gate_pass", hangs)
    run_control(rt)
    assert [list(books) for books, _ in failed] == [BOOKS[5:]]
    tick(rt)
    run_control(rt)
    assert all(generating(rt, b) for b in BOOKS) and held(rt) == []


def test_a_give_away_whose_due_write_failed_outlives_its_batch(rt: Wiring, monkeypatch, short_hold) -> None:
    """The stalled pass returned before the next renewal: the batch's release let the given books go, not due nor
    held, their work waiting for reconcile's round."""
    real_pass, failed = gate.gate_pass, give_away_refused(rt, monkeypatch)

    def hangs_until_the_give_away_failed(ports, name, **kwargs):  # type: ignore[no-untyped-def]
        while name == "b04" and not failed:
            time.sleep(0.01)
        return real_pass(ports, name, **kwargs)

    monkeypatch.setattr(gate, "gate_pass", hangs_until_the_give_away_failed)
    run_control(rt)
    time.sleep(HOLD / 2)  # the renewing thread writes it
    assert [list(books) for books, _ in failed] == [BOOKS[5:]] and sorted(tick(rt)) == BOOKS[5:]
    run_control(rt)
    assert all(generating(rt, b) for b in BOOKS) and held(rt) == []


def test_a_regenerate_whose_pass_ended_forgets_the_books_lost_passes(rt: Wiring, short_hold) -> None:
    lane(rt, lane_limit=4)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    rt.redis.client.hset(rt.redis.keys.held_pass_lapses(), "b", 3)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert generating(rt, "b") and lapses(rt) == {}


def test_a_release_redis_refused_is_tried_again(rt: Wiring, monkeypatch, short_hold) -> None:
    """Let lapse, the passes of a batch that ended well were sent again and counted lost; three such batches gave
    healthy books up."""
    workers_back(rt)
    tick(rt)
    failed = refuses_once(rt, monkeypatch, "let_go_passes")
    run_control(rt)
    time.sleep(HOLD + 0.1)
    assert failed and held(rt) == [] and tick(rt) == [] and lost_passes(rt) is None


@pytest.mark.parametrize("member", ["b00", "holder:b00"])
def test_a_lapsed_member_of_either_shape_is_sent_again(rt: Wiring, member: str) -> None:
    """A member of one book only (as 5cff974 wrote them) raised in the tick, and every hold lapsed then was lost."""
    rt.redis.client.zadd(rt.redis.keys.held_passes(), {member: 0})
    assert tick(rt) == ["b00"]


def test_a_tick_whose_take_redis_refused_still_gives_up_a_book(rt: Wiring, monkeypatch, short_hold, caplog) -> None:
    """The lapsed holds were taken in one step and the due books in another: the second refused, the lapsed books
    went back on the due index, and a book lost a third time was sent again, alone, by the next tick."""
    workers_back(rt)
    rt.redis.client.zrem(rt.redis.keys.due(), "b04")  # its pass under way: off the index, held
    rt.redis.client.hset(rt.redis.keys.held_pass_lapses(), "b04", 2)  # lost twice before
    pass_hold.PassHold(rt.ports, ["b04"]).abandon()
    time.sleep(HOLD + 0.1)
    refuses_once(rt, monkeypatch, "take_due")
    with pytest.raises(StoreUnavailable):
        tick(rt)
    assert sorted(tick(rt)) == [b for b in BOOKS if b != "b04"] and "b04" not in str(queued_batches(rt))
    assert "book='b04' 3 times: pass lost with its control process" in caplog.text and lapses(rt) == {"b04": "3"}


def test_a_first_write_whose_answer_was_lost_is_not_written_back_taken(rt: Wiring, monkeypatch, short_hold) -> None:
    """The write landed, its answer lost, and Redis refused the renewal's tries until the hold lapsed: the tick sent
    the book again, then the renewal wrote the hold back, and the book's pass ran twice (counted lost twice, should
    its holder die)."""
    real, calls, allow = rt.ports.book_state.hold_passes, [], threading.Event()

    def answer_lost(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        if len(calls) == 1 or not allow.is_set():
            if len(calls) == 1:
                real(*args, **kwargs)
            raise StoreUnavailable("redis", rt.settings.redis_url, "Timeout reading from socket")
        return real(*args, **kwargs)

    monkeypatch.setattr(rt.ports.book_state, "hold_passes", answer_lost)
    hold = pass_hold.PassHold(rt.ports, ["b00"])
    time.sleep(HOLD + 0.2)
    assert tick(rt) == ["b00"] and held(rt) == []  # lapsed: taken, sent again
    allow.set()
    time.sleep(HOLD / 2)  # the renewing thread's turns
    assert held(rt) == []
    hold.release()


def test_a_slow_first_write_by_the_renewal_holds_up_no_pass(rt: Wiring, monkeypatch, short_hold) -> None:
    """Written under the holder's lock, a write hung on a dead connection (5 s, Redis's socket timeout) held up each
    pass's start and end as long."""
    real, calls, writing = rt.ports.book_state.hold_passes, [], threading.Event()

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        if len(calls) == 1:
            raise StoreUnavailable("redis", rt.settings.redis_url, "connection reset by peer")
        writing.set()
        time.sleep(2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(rt.ports.book_state, "hold_passes", slow)
    with pass_hold.PassHold(rt.ports, ["b00", "b01"]) as hold:
        assert writing.wait(5)
        started = time.monotonic()
        assert hold.starts("b00")
        hold.ended("b00")
        assert time.monotonic() - started < 0.5
    time.sleep(2.0 + HOLD)  # the write lands after the release: the renewal takes it away again
    assert held(rt) == []
