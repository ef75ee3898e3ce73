"""A gate batch lost with its control worker, or a regenerate killed before its first pass ended: the books' passes
are sent again when the hold lapses.

Control tasks are acknowledged when they start; a batch whose worker died (a deploy's SIGKILL, the OOM killer)
had taken its books off the due index for nothing, and they waited for reconcile's paged round, their GPU slots
idle. Real Postgres, Redis and broker; control messages run through the real tasks (`run_control`); a worker's
death is a `BaseException` raised inside a pass (no error handling runs, as none would in a killed process).
"""

from __future__ import annotations

import time

import pytest

from animastor_tasks.domain.keys import parse_held_pass_member
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import gate, pass_hold
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book
from .test_due_index_lost import BOOKS, awaiting_workers, due, generating, tick
from .test_elastic_share import lane, run_control

HOLD = 0.5  # seconds: a batch's hold here (20 s in production)


class WorkerDied(BaseException):
    """The control worker killed in the middle of a batch."""


def held(rt: Wiring) -> list[str]:
    """The books whose pass is held, once per holder."""
    return sorted(parse_held_pass_member(str(m)) for m in rt.redis.client.zrange(rt.redis.keys.held_passes(), 0, -1))


def lost_passes(rt: Wiring) -> str | None:
    rt.counters.flush()
    return rt.redis.client.hget(rt.redis.keys.metrics(), "lost_pass")  # animastor_lost_gate_passes_total


def workers_back(rt: Wiring) -> None:
    """Every book due now, with its audio pair pending and a live GPU worker."""
    awaiting_workers(rt)
    rt.redis.client.zadd(rt.redis.keys.due(), dict.fromkeys(BOOKS, 0))
    rt.redis.recovered_at = float("-inf")
    advertise(rt, "gpu.audio")


def dies_at(monkeypatch: pytest.MonkeyPatch, book: str) -> list[str]:
    """The batch's worker dies as the pass of `book` starts; the books passed before it."""
    real, passed = gate.gate_pass, []

    def gate_pass(ports, name, **kwargs):  # type: ignore[no-untyped-def]
        if name == book:
            raise WorkerDied(name)
        passed.append(name)
        return real(ports, name, **kwargs)

    monkeypatch.setattr(gate, "gate_pass", gate_pass)
    return passed


def refuses_once(rt: Wiring, monkeypatch: pytest.MonkeyPatch, method: str) -> list[tuple[object, ...]]:
    """`rt.ports.book_state.<method>` refuses its first call (Redis reset the connection); that call's arguments."""
    real, refused = getattr(rt.ports.book_state, method), []

    def once(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not refused:
            refused.append(args)
            raise StoreUnavailable("redis", rt.settings.redis_url, "connection reset by peer")
        return real(*args, **kwargs)

    monkeypatch.setattr(rt.ports.book_state, method, once)
    return refused


@pytest.fixture
def short_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pass_hold, "HOLD_SECONDS", HOLD)


def test_the_passes_of_a_batch_whose_worker_died_are_sent_again(rt: Wiring, monkeypatch, short_hold) -> None:
    """Before: after the death no tick sent anything, and 8 of the 12 books stayed pending until reconcile."""
    workers_back(rt)
    assert sorted(tick(rt)) == BOOKS
    with monkeypatch.context() as dying, pytest.raises(WorkerDied):
        passed = dies_at(dying, "b04")
        run_control(rt)
    assert passed == BOOKS[:4] and not due(rt)
    assert not any(generating(rt, book) for book in BOOKS[4:])
    assert tick(rt) == []  # the hold stands: the batch may still be running
    time.sleep(HOLD + 0.1)
    assert sorted(tick(rt)) == BOOKS  # every book the batch carried, those passed before its death among them
    run_control(rt)
    assert all(generating(rt, book) for book in BOOKS) and held(rt) == []
    assert lost_passes(rt) == "12"


def test_a_batch_that_ends_lets_its_holds_go(rt: Wiring, short_hold) -> None:
    workers_back(rt)
    assert sorted(tick(rt)) == BOOKS
    run_control(rt)
    assert held(rt) == [] and all(generating(rt, book) for book in BOOKS)


def test_a_batch_that_fails_lets_its_holds_go(rt: Wiring, monkeypatch, short_hold) -> None:
    """An error is not a death: sent again each hold, a pass that fails the same way would run for ever."""
    workers_back(rt)
    tick(rt)

    def broken(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in a pass")

    monkeypatch.setattr(gate, "gate_pass", broken)
    with pytest.raises(RuntimeError):
        run_control(rt)
    assert held(rt) == []


def test_a_queue_behind_sends_no_pass_twice(rt: Wiring, short_hold) -> None:
    """A hold starts when its batch starts: batches waiting in the control queue longer than a hold are not
    sent again (a hold from the tick's send queued each due book's pass once per hold while control lagged)."""
    workers_back(rt)
    assert sorted(tick(rt)) == BOOKS
    time.sleep(HOLD + 0.1)
    assert tick(rt) == [] and held(rt) == []
    ran = run_control(rt)
    assert [name for name, _ in ran] == ["animastor.gate_batch"]


def test_an_older_batch_does_not_let_go_of_a_newer_ones_hold(rt: Wiring) -> None:
    """Two batches of one book (a regenerate made it due again while the first ran): each lets go of its own hold
    only, so the newer batch's death is still seen."""
    first = pass_hold.PassHold(rt.ports, ["b00", "b01"])
    second = pass_hold.PassHold(rt.ports, ["b01"])
    assert held(rt) == ["b00", "b01", "b01"]
    first.release()
    assert held(rt) == ["b01"]
    second.release()
    assert held(rt) == []


def test_a_slow_pass_keeps_its_batch_held(rt: Wiring, monkeypatch, short_hold) -> None:
    """Renewed only between passes, a hold lapsed during one pass longer than half of it: the tick sent the whole
    batch again, once a hold for as long as that pass stayed slow, each counted as lost with a worker that lived
    (a review's case: 5 batches, 48 passes counted lost)."""
    workers_back(rt)
    assert sorted(tick(rt)) == BOOKS
    real, ticks = gate.gate_pass, []

    def slow(ports, name, **kwargs):  # type: ignore[no-untyped-def]
        if name == "b04" and not ticks:  # once: on the old hold, each batch sent again was as slow
            time.sleep(HOLD * 1.5)
            ticks.append(tick(rt))
        return real(ports, name, **kwargs)

    monkeypatch.setattr(gate, "gate_pass", slow)
    run_control(rt)
    assert ticks == [[]] and held(rt) == [] and lost_passes(rt) is None
    assert all(generating(rt, book) for book in BOOKS)


def test_a_regenerate_killed_before_its_pass_ended_has_its_book_passed(rt: Wiring, monkeypatch, short_hold) -> None:
    """Its commands were written, its process died in its first pass: before, nothing made the book due, and its
    work waited for reconcile's round."""
    lane(rt, lane_limit=4)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    with monkeypatch.context() as dying, pytest.raises(WorkerDied):
        dies_at(dying, "b")
        regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert not generating(rt, "b") and tick(rt) == []
    time.sleep(HOLD + 0.1)
    assert tick(rt) == ["b"]
    run_control(rt)
    assert generating(rt, "b") and held(rt) == []


def test_a_regenerate_lets_its_hold_go(rt: Wiring, short_hold) -> None:
    lane(rt, lane_limit=4)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert generating(rt, "b") and held(rt) == []


def test_a_slow_first_pass_of_a_regenerate_keeps_its_hold(rt: Wiring, monkeypatch, short_hold) -> None:
    """Not renewed, a regenerate's hold lapsed during a first pass longer than it (a lock wait, a revoke)."""
    lane(rt, lane_limit=4)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    real, ticks = gate.gate_pass, []

    def slow(ports, name, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(HOLD * 1.5)
        ticks.append(tick(rt))
        return real(ports, name, **kwargs)

    monkeypatch.setattr(gate, "gate_pass", slow)
    monkeypatch.setattr(pass_hold, "STALL_SECONDS", HOLD)  # its one book is the pass running: never given up
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert ticks == [[]] and held(rt) == [] and lost_passes(rt) is None and generating(rt, "b")


def test_a_regenerate_whose_pass_raised_leaves_its_book_due(rt: Wiring, monkeypatch, short_hold) -> None:
    """Its commands are written: the next tick passes the book, not the hold's lapse 20 s later."""
    lane(rt, lane_limit=4)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))

    def broken(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in a pass")

    with monkeypatch.context() as failing, pytest.raises(RuntimeError):
        failing.setattr(gate, "gate_pass", broken)
        regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert held(rt) == [] and due(rt) == {"b"}


def test_a_regenerate_during_a_batch_leaves_the_batch_its_hold(rt: Wiring, monkeypatch, short_hold) -> None:
    """One hold per book: the regenerate wrote over the batch's and let it go, and the batch's death at that
    book went unseen."""
    workers_back(rt)
    assert sorted(tick(rt)) == BOOKS
    real = gate.gate_pass

    def gate_pass(ports, name, **kwargs):  # type: ignore[no-untyped-def]
        if name == "b02":
            regenerate_flow.regenerate(rt.ports, "b05", ["audio"])
        if name == "b05" and kwargs.get("snapshot") is None:  # the batch's pass, not the regenerate's
            raise WorkerDied(name)
        return real(ports, name, **kwargs)

    with monkeypatch.context() as dying, pytest.raises(WorkerDied):
        dying.setattr(gate, "gate_pass", gate_pass)
        run_control(rt)
    time.sleep(HOLD + 0.1)
    assert "b05" in tick(rt)


def test_a_renewal_that_failed_does_not_send_a_finished_batch_again(rt: Wiring, monkeypatch, short_hold) -> None:
    """One Redis error in a renewal ended the hold's writes: the batch's release wrote nothing, and every book it
    had passed was sent again and counted as lost."""
    workers_back(rt)
    tick(rt)
    real_pass, failed = gate.gate_pass, refuses_once(rt, monkeypatch, "renew_passes")

    def slow(ports, name, **kwargs):  # type: ignore[no-untyped-def]
        if name == "b04":
            time.sleep(HOLD)  # two renewals
        return real_pass(ports, name, **kwargs)

    monkeypatch.setattr(gate, "gate_pass", slow)
    run_control(rt)
    time.sleep(HOLD + 0.1)
    assert failed and held(rt) == [] and tick(rt) == [] and lost_passes(rt) is None


def test_a_hold_whose_first_write_redis_refused_is_written_by_the_renewal(rt: Wiring, monkeypatch, short_hold) -> None:
    """Refused as its batch started, the hold was never written: the worker died, and the books it had not passed
    yet waited for reconcile's round (nor did a pass that stalled give the books after it to the tick)."""
    workers_back(rt)
    assert sorted(tick(rt)) == BOOKS
    refused, real = refuses_once(rt, monkeypatch, "hold_passes"), gate.gate_pass

    def dies_late(ports, name, **kwargs):  # type: ignore[no-untyped-def]
        if name == "b04":
            time.sleep(HOLD)  # the renewing thread's turns
            raise WorkerDied(name)
        return real(ports, name, **kwargs)

    with monkeypatch.context() as dying, pytest.raises(WorkerDied):
        dying.setattr(gate, "gate_pass", dies_late)
        run_control(rt)
    assert refused and held(rt) == BOOKS[4:]
    time.sleep(HOLD + 0.1)
    assert sorted(tick(rt)) == BOOKS[4:]
    run_control(rt)
    assert all(generating(rt, book) for book in BOOKS) and held(rt) == []
