"""Reconcile takes the books with work in turns: each pass the next ones up to `ANIMASTOR_RECONCILE_PAIRS` pairs in
flight, the round coming back to the first book after the last. Passing every book each time cost 16 s of a
control process every 30 s at a million pairs in flight. Real Postgres and Redis."""

from __future__ import annotations

from dataclasses import replace

from animastor_tasks.adapters.redis.counters import buckets_for, histogram_field
from animastor_tasks.config import Settings
from animastor_tasks.domain.liveness import PERIODIC_LOCK_SHARE
from animastor_tasks.domain.vocabulary import AssetState
from animastor_tasks.flow import gate, rebuild
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, read_calls, states, use_settings

BOOKS = [f"b{n}" for n in range(6)]


def _farm(rt: Wiring) -> None:
    """Six books of four audio pairs in flight each; reconcile may pass eight pairs, two books, at a time."""
    advertise(rt, "gpu.audio")
    for book in BOOKS:
        rt.catalog.import_book(make_book(book, chapters=2, scenes=2))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    use_settings(rt, replace(rt.settings, reconcile_pairs=8))
    assert rt.ports.commands.books_with_work() == {book: 4 for book in BOOKS}


def _pending(rt: Wiring, book: str) -> int:
    return sum(state == AssetState.PENDING for state in states(rt, book).values())


def test_each_pass_repairs_the_next_books_within_its_budget_and_the_round_comes_back(rt: Wiring) -> None:
    _farm(rt)
    with rt.db.transaction() as conn:  # b4's command ended without its flow's cleanup: its pairs lost their authority
        conn.execute("UPDATE commands SET status = 'cancelled' WHERE book_id = 'b4'")
    stranded = _pending(rt, "b4")
    assert stranded > 0
    passes = read_calls(rt, "gate_rows_many", "gate_rows")
    rebuilds = read_calls(rt, "in_flight_scene_pages")

    def one_pass() -> tuple[list[str], list[str], dict[str, object]]:
        passes.clear()
        rebuilds.clear()
        report = reconcile_flow.reconcile(rt.ports, force=True)
        # A book whose pass releases pairs reads them once more under its lock (`Assets.release_denied`): not a pass.
        passed = sorted(b for c in passes if not isinstance(c[0], str) for b in c[0])
        return passed, sorted(b for c in rebuilds for b in c[0]), report

    rt.redis.client.delete(rt.redis.keys.bookmark(rebuild.BOOKMARK))  # lost with Redis's data, or never written
    passed, rebuilt, report = one_pass()  # no bookmark: every book's active index is rebuilt
    assert (passed, rebuilt) == (["b0", "b1"], BOOKS)
    assert (report["passed_books"], report["books_with_work"], report["round_done"]) == (2, 6, False)
    assert _pending(rt, "b4") == stranded  # not its turn yet
    passed, rebuilt, report = one_pass()
    assert passed == rebuilt == ["b2", "b3"] and not report["round_done"]
    passed, rebuilt, report = one_pass()
    assert passed == rebuilt == ["b4", "b5"] and report["round_done"]
    assert report["released"] == stranded and _pending(rt, "b4") == 0
    passed, rebuilt, _ = one_pass()
    assert passed == rebuilt == ["b0", "b1"]  # the next round
    rt.counters.flush()  # each pass times itself for the exporter's `animastor_reconcile_seconds`
    timed = rt.redis.client.hget(rt.redis.keys.metrics(), histogram_field("reconcile_seconds", "count"))
    assert int(timed) == 4


def test_a_lost_bookmark_rebuilds_every_books_index_and_a_whole_pass_visits_every_book(rt: Wiring) -> None:
    _farm(rt)
    reconcile_flow.reconcile(rt.ports, force=True)
    reconcile_flow.reconcile(rt.ports, force=True)  # the round goes on at b4
    lost = [rt.redis.keys.active_scenes(book) for book in BOOKS] + [rt.redis.keys.bookmark("reconcile")]
    rt.redis.client.delete(*lost)  # gone with Redis's data
    passes = read_calls(rt, "gate_rows_many", "gate_rows")
    report = reconcile_flow.reconcile(rt.ports, force=True)
    assert sorted(b for c in passes for b in c[0]) == ["b0", "b1"]  # the round starts again
    assert report["rebuilt_books"] == len(BOOKS)
    assert all(len(rt.redis.client.smembers(rt.redis.keys.active_scenes(book))) == 4 for book in BOOKS)
    passes.clear()
    rt.counters.flush()
    timed = rt.redis.client.hget(rt.redis.keys.metrics(), histogram_field("reconcile_seconds", "count"))
    report = reconcile_flow.reconcile(rt.ports, force=True, whole=True)  # `animastor-tasks reconcile`
    assert sorted(b for c in passes for b in c[0]) == BOOKS
    assert (report["passed_books"], report["round_done"]) == (6, True)
    # The beat's passes alone are timed: a whole-farm pass (16 s at a million pairs) skewed their percentiles.
    rt.counters.flush()
    assert rt.redis.client.hget(rt.redis.keys.metrics(), histogram_field("reconcile_seconds", "count")) == timed


def test_redis_data_lost_during_a_pass_leaves_no_bookmark_so_the_next_pass_rebuilds_every_book(
    rt: Wiring, monkeypatch
) -> None:
    """The pass read the bookmark before the loss and wrote the next one after it: the next pass, finding one,
    rebuilt only its own slice, and the other books (their active index and due entries gone) waited for the round
    to come to them, 5 minutes at a million pairs, their slots idle."""
    _farm(rt)
    reconcile_flow.reconcile(rt.ports, force=True)  # a round under way, as on a live farm
    real = reconcile_flow._expire_dead_generating

    def data_lost_then(ports: object, report: dict[str, object]) -> None:
        rt.redis.client.flushdb()
        real(ports, report)

    monkeypatch.setattr(reconcile_flow, "_expire_dead_generating", data_lost_then)
    reconcile_flow.reconcile(rt.ports, force=True)
    assert rt.ports.locks.bookmark("reconcile") is None
    # Lost again during the pass that rebuilds every book (a Redis that crash-loops): the same.
    reconcile_flow.reconcile(rt.ports, force=True)
    monkeypatch.setattr(reconcile_flow, "_expire_dead_generating", real)
    assert rt.ports.locks.bookmark("reconcile") is None
    report = reconcile_flow.reconcile(rt.ports, force=True)
    assert report["rebuilt_books"] == len(BOOKS)
    assert all(len(rt.redis.client.smembers(rt.redis.keys.active_scenes(book))) == 4 for book in BOOKS)
    assert rt.ports.locks.bookmark("reconcile") == "b1"  # the round goes on as usual


def test_a_reconcile_pass_as_long_as_its_lock_lands_in_a_finite_bucket() -> None:
    """The duration buckets ended at 10 s: a pass nearing its lock (0.8 x the 30 s period) read as 10 s at p99."""
    lock = Settings().reconcile_seconds * PERIODIC_LOCK_SHARE
    assert any(lock <= bound < float("inf") for bound in buckets_for("reconcile_seconds"))


def test_the_tick_and_reconcile_each_hold_their_singleton_lock_for_the_same_share_of_their_period(rt: Wiring) -> None:
    """A second beat's pass is skipped while the lock lives; it lapses before the next period, so a pass whose
    holder died is taken up by the next beat."""
    use_settings(rt, replace(rt.settings, tick_seconds=5, reconcile_seconds=30))
    client, keys = rt.redis.client, rt.redis.keys
    client.delete(keys.lock("tick"), keys.lock("reconcile"))
    gate.tick(rt.ports)
    assert reconcile_flow.reconcile(rt.ports).get("skipped") is None
    assert gate.tick(rt.ports) == [] and reconcile_flow.reconcile(rt.ports) == {"skipped": True}
    assert 3_000 < client.pttl(keys.lock("tick")) <= 4_000  # 0.8 x 5 s, less the time since
    assert 23_000 < client.pttl(keys.lock("reconcile")) <= 24_000  # 0.8 x 30 s
