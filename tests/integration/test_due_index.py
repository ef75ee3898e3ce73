"""The due index: the tick passes only the books that need a pass now, several per task; a lane without
room costs a batch no claim transaction; under a backlog of many books the slots go round in order.

Real Postgres, Redis and broker; control messages are run through the real tasks (`run_control`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, lanes, rebuild
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.flow.job import Job
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, fake_artifact, make_book, states, use_settings
from .test_elastic_share import finish_one, lane, run_control, running


def tick(rt: Wiring) -> list[str]:
    rt.redis.client.delete(rt.redis.keys.lock("tick"))
    return gate.tick(rt.ports)


def control_messages(rt: Wiring) -> int:
    import redis

    client = redis.Redis.from_url(rt.settings.broker_url)
    try:
        return int(client.llen(CONTROL_QUEUE))
    finally:
        client.close()


def short_capacity_window(rt: Wiring, seconds: int = 1) -> None:
    use_settings(rt, replace(rt.settings, capacity_defer_seconds=seconds))


def test_a_book_with_nothing_to_do_is_not_visited_by_the_tick(rt) -> None:
    lane(rt, lane_limit=2, book_quota=2, window=2)
    short_capacity_window(rt)
    rt.catalog.import_book(make_book("running", chapters=1, scenes=2))
    rt.catalog.import_book(make_book("waiting", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "running", ["audio"])  # both scenes run: nothing left to pass
    regenerate_flow.regenerate(rt.ports, "waiting", ["audio"])  # lane full: deferred for 1 s
    assert rt.ports.book_state.active_books() == {"running", "waiting"}
    assert tick(rt) == []  # neither needs a pass now
    assert control_messages(rt) == 0
    time.sleep(1.1)  # the deferrals of `waiting` end
    assert tick(rt) == ["waiting"]
    assert tick(rt) == []  # asked for once, however many ticks pass before its pass runs
    assert [name for name, _ in run_control(rt)] == ["animastor.gate_batch"]
    assert tick(rt) == []  # its pass found the lane still full and put it back for when its deferral ends


def test_after_redis_lost_its_data_the_next_tick_makes_every_book_with_work_due(rt) -> None:
    """Redis emptied (a restart without persistence, a flush, a failover to an empty replica): the due index and the
    lanes' waiting lists went with it, and a freed slot was handed to nobody until reconcile's next pass (30 s).
    The tick sees the loss by reconcile's bookmark being gone and makes every book with work due at once; with the
    bookmark there, it makes none due."""
    lane(rt, lane_limit=1)
    for book in ("holder", "waiting"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    rt.catalog.import_book(make_book("idle", chapters=1, scenes=1))  # no command: no work
    assert tick(rt) == []  # both wait for their deferrals: neither is due
    rt.redis.client.flushdb()
    advertise(rt, "gpu.audio")
    assert sorted(tick(rt)) == ["holder", "waiting"]
    assert rt.ports.book_state.active_books() == {"holder", "waiting"}
    assert rt.ports.locks.bookmark(rebuild.BOOKMARK) == ""  # reconcile's round starts from its first book
    assert tick(rt) == []  # rebuilt once: the next tick finds the bookmark


def test_a_pass_lost_on_the_way_is_asked_for_again_by_reconcile(rt) -> None:
    lane(rt, lane_limit=1)
    short_capacity_window(rt)
    for book in ("holder", "lost"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    time.sleep(1.1)
    assert "lost" in tick(rt)
    run_control_dropped = control_messages(rt)
    import redis

    redis.Redis.from_url(rt.settings.broker_url).delete(CONTROL_QUEUE)  # the gate task is lost
    assert run_control_dropped == 1 and tick(rt) == []
    reconcile_flow.reconcile(rt.ports, force=True)  # its dispatch-free pass puts the book back
    assert "lost" in tick(rt)


def due_books_of_a_full_lane(rt: Wiring) -> list[str]:
    """54 books of one scene on a lane of one slot: b000 runs, the others are due again once their capacity
    deferrals (1 s) have run out."""
    lane(rt, lane_limit=1)
    short_capacity_window(rt)
    books = [f"b{i:03d}" for i in range(lanes.BATCH_BOOKS + 5)]
    for book in books:
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    time.sleep(1.1)
    return books


def test_the_tick_sends_the_due_books_in_batches(rt) -> None:
    books = due_books_of_a_full_lane(rt)
    assert sorted(tick(rt)) == books[1:]  # b000 runs; every other book waits for the lane
    assert control_messages(rt) == 2  # 54 books: one task of 50 and one of 4


def test_due_books_whose_passes_the_broker_refuses_are_due_again(rt, monkeypatch) -> None:
    """The tick took the due books off the index, then its publish failed (the broker restarted mid-tick): nothing
    put them back, and they waited for reconcile's round to reach them, 30 s or several rounds."""
    books = due_books_of_a_full_lane(rt)
    sent: list[list[str]] = []
    real = rt.ports.publisher.enqueue_gates

    def refused_second(book_ids: list[str]) -> None:
        if sent:
            raise StoreUnavailable("broker", rt.settings.broker_url, "connection reset")
        sent.append(list(book_ids))
        real(book_ids)

    monkeypatch.setattr(rt.ports.publisher, "enqueue_gates", refused_second)
    with pytest.raises(StoreUnavailable):
        tick(rt)
    unsent = set(books[1:]) - set(sent[0])
    assert len(unsent) == 4
    due = {str(b) for b in rt.redis.client.zrange(rt.redis.keys.due(), 0, -1)}
    assert unsent <= due and not due & set(sent[0])
    monkeypatch.undo()
    assert sorted(tick(rt)) == sorted(unsent)  # the next tick sends them


class ClaimCounter:
    """The real asset store, counting claim transactions; `between` runs between the batch's two lane counts."""

    def __init__(self, inner: Any, between: Any = None) -> None:
        self.inner, self.claims, self.loads, self.between = inner, 0, 0, between

    def claiming(self, *args: Any, **kwargs: Any) -> Any:
        self.claims += 1
        return self.inner.claiming(*args, **kwargs)

    def lane_load(self, stages: Any) -> dict[str, int]:
        self.loads += 1
        load = self.inner.lane_load(stages)
        if self.loads == 1 and self.between is not None:
            self.between()
        return load

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_lane_without_room_costs_a_batch_no_claim_and_a_slot_freed_meanwhile_is_handed_on(rt) -> None:
    lane(rt, lane_limit=1)
    short_capacity_window(rt)
    books = [f"w{i}" for i in range(5)]
    for book in ["holder", *books]:
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    rt.redis.client.delete(rt.redis.keys.lane_waiters("gpu.audio"))  # nobody waits yet when the job ends
    time.sleep(1.1)
    with rt.db.transaction() as conn:
        c, s, st, dispatch_id, token = conn.execute(
            "SELECT chapter_id, scene_id, stage, dispatch_id, fencing_token FROM asset_states"
            " WHERE book_id = 'holder' AND state = 'generating'"
        ).fetchone()

    def job_ends() -> None:  # after the batch saw the lane full, before its books join the waiting list
        assert run_job(rt.ports, Job("holder", c, s, st, dispatch_id, token), worker="t")["outcome"] == "ready"

    counter = ClaimCounter(rt.ports.assets, between=job_ends)
    rt.ports = replace(rt.ports, assets=counter)
    reports = gate.gate_batch(rt.ports, books)
    assert counter.claims == 0 and counter.loads == 2
    assert all(r.outcomes == {"lane_full": 1} for r in reports)
    # The freed slot was handed to the first waiting book, not left for a deferral to end.
    rt.ports = replace(rt.ports, assets=counter.inner)
    run_control(rt)
    assert running(rt, "holder", *books) == {"w0": 1}


def test_slots_go_round_the_books_in_the_order_they_asked_under_a_backlog(rt) -> None:
    lane(rt, lane_limit=2, book_quota=1, window=1)
    books = [f"book{i:02d}" for i in range(30)]
    for book in books:
        rt.catalog.import_book(make_book(book, chapters=1, scenes=2))
    for book in books:
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    starts: list[str] = []
    for _ in range(70):
        with rt.db.transaction() as conn:
            row = conn.execute(
                "SELECT book_id, chapter_id, scene_id, stage, dispatch_id, fencing_token FROM asset_states"
                " WHERE state = 'generating' ORDER BY updated_at LIMIT 1"
            ).fetchone()
        if row is None:
            break
        book, c, s, st, dispatch_id, token = row
        starts.append(book)
        assert run_job(rt.ports, Job(book, c, s, st, dispatch_id, token), worker="t")["outcome"] == "ready"
        run_control(rt)
    assert all(state == "ready" for b in books for state in states(rt, b).values())
    first = [b for i, b in enumerate(starts) if b not in starts[:i]]
    assert first == books  # each book's first job in the order the books asked
    assert starts.index(books[-1]) <= len(books) + 1  # the last book waited about one job per book ahead


def test_a_batch_reads_the_facts_of_its_books_together_as_each_pass_would_alone(rt) -> None:
    lane(rt, lane_limit=2)
    for book in ("one", "two"):
        rt.catalog.import_book(make_book(book, chapters=2, scenes=3))
        regenerate_flow.regenerate(rt.ports, book, ["audio"], priority="bulk" if book == "two" else None)
    together = rt.ports.assets.gate_rows_many(["one", "two", "nobody"])
    assert together == {
        "one": rt.ports.assets.gate_rows("one"),
        "two": rt.ports.assets.gate_rows("two"),
        "nobody": None,
    }
    now = time.time()
    queues = rt.settings.registry.queues()
    snaps = rt.ports.book_state.book_snapshots(["one", "two"], now, queues)
    assert snaps == {b: rt.ports.book_state.book_snapshots([b], now, queues)[b] for b in ("one", "two")}
    assert snaps["two"].first_deferral_end
    assert list(snaps["two"].waiters["gpu.audio"].items()) == [("one", 1), ("two", 2)]  # normal, then bulk


def test_a_regenerate_reads_its_passs_snapshot_with_its_own_writes_as_the_pass_would_after_them(rt) -> None:
    lane(rt, lane_limit=2)
    rt.catalog.import_book(make_book("one", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "one", ["audio"])  # a waiting list, a deferral, a due entry to read
    rt.catalog.import_book(make_book("two", chapters=1, scenes=2))
    now, queues = time.time(), rt.settings.registry.queues()
    pairs = [("ch1", f"s{i}", "audio") for i in (1, 2)]
    read = rt.ports.book_state.start_work("two", pairs, [p[:2] for p in pairs], force_ttl=60, snapshot=(now, queues))
    assert read == rt.ports.book_state.book_snapshots(["two"], now, queues)["two"]
    assert read.force == set(pairs) and read.active == {p[:2] for p in pairs}  # the writes, seen
    assert read.waiters == {"gpu.audio": {"one": 1}} and read.consumers == {"gpu.audio": 1}
    assert rt.ports.book_state.start_work("two", pairs, [p[:2] for p in pairs], force_ttl=None) is None


def test_a_batch_releases_nothing_on_facts_that_a_stop_all_and_a_new_regenerate_have_overtaken(rt, monkeypatch) -> None:
    """A batch reads its books' facts first and passes them one by one. A Stop All that set its flag before the
    read, then released the book and a new regenerate pended its pairs again before the book's pass: the pass
    released the new command's pairs on the old flag, and the command ended with nothing done."""
    lane(rt, lane_limit=1)
    rt.catalog.import_book(make_book("other", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "other", ["audio"])  # the one slot: taken, so the book's pairs wait
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    read_facts = gate._read_facts

    def overtaken(ports: Any, books: Any) -> Any:
        rt.ports.book_state.stop_book("b")  # Stop All: its flag first
        facts = read_facts(ports, books)
        cancel_flow.cancel(rt.ports, "b")  # then the rest of it
        regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # and a new intent, before the book's pass
        return facts

    monkeypatch.setattr(gate, "_read_facts", overtaken)
    [report] = gate.gate_batch(rt.ports, ["b"])
    assert report.released == []
    assert set(states(rt, "b").values()) == {"pending"}
    newest = max(rt.ports.commands.commands(book="b"), key=lambda c: c.created_at)
    assert newest.status == "active", newest


def test_a_single_books_pass_releases_nothing_on_a_flag_a_stop_all_and_a_new_regenerate_have_overtaken(
    rt, monkeypatch
) -> None:
    """The same race in a single book's pass (and a paged one, whose facts may be seconds old): the pass read its
    rows, the Stop All set its flag, the pass read its snapshot (the flag set: every pair denied), the Stop All
    released the pairs and a regenerate pended them again under a new command; the pass then released them on
    the flag it had read, no target of the new command was marked released, and it stayed active for ever."""
    lane(rt, lane_limit=1)
    rt.catalog.import_book(make_book("other", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "other", ["audio"])  # the one slot: taken, so the book's pairs wait
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    snapshots = rt.ports.book_state.book_snapshots
    raced: list[bool] = []

    def overtaken(books: Any, *args: Any, **kwargs: Any) -> Any:
        if raced or books != ["b"]:
            return snapshots(books, *args, **kwargs)
        raced.append(True)
        rt.ports.book_state.stop_book("b")  # Stop All: its flag first
        snap = snapshots(books, *args, **kwargs)
        cancel_flow.cancel(rt.ports, "b")  # then the rest of it
        regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # and a new intent, before the pass's release
        return snap

    monkeypatch.setattr(rt.ports.book_state, "book_snapshots", overtaken)
    report = gate.gate_pass(rt.ports, "b")
    monkeypatch.undo()
    assert raced and report.released == []
    assert set(states(rt, "b").values()) == {"pending"}
    newest = max(rt.ports.commands.commands(book="b"), key=lambda c: c.created_at)
    assert newest.status == "active", newest


def test_reconcile_hands_on_a_free_slot_whose_refill_was_lost(rt) -> None:
    """A job that ended without its refill (its process died after the commit; Redis failed under the refill and
    its fallback) left its slot free. The book's pairs waited on capacity deferrals that each later refill of
    the lane wrote again, so the lane stayed a slot short for as long as the book's other jobs kept ending."""
    lane(rt, lane_limit=2)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert running(rt, "b") == {"b": 2}
    rt.ports.deferrals.wait_for_lane("gpu.audio", "b", 0)  # it waits for the lane, as a refused refill leaves it
    with rt.db.transaction() as conn:
        c, s, st, dispatch_id, token = conn.execute(
            "SELECT chapter_id, scene_id, stage, dispatch_id, fencing_token FROM asset_states"
            " WHERE book_id = 'b' AND state = 'generating' ORDER BY scene_id LIMIT 1"
        ).fetchone()
    assert rt.ports.jobs.commit_job("b", (c, s, st), token, dispatch_id, fake_artifact("a"), "gpu.audio")
    assert running(rt, "b") == {"b": 1}  # and no refill
    reconcile_flow.reconcile(rt.ports, force=True)
    run_control(rt)
    assert running(rt, "b") == {"b": 2}


def test_a_book_whose_pairs_belong_to_a_stage_no_longer_registered_is_not_passed_on_every_tick(rt) -> None:
    """A stage removed from ANIMASTOR_STAGES (or a control worker configured without it) left its pending pairs
    neither dispatched nor counted as handled: the pass asked for the book again at once, every tick, for ever."""
    registry = rt.settings.registry
    capped = replace(registry, stages=tuple(replace(s, book_cap=1) for s in registry.stages))
    use_settings(rt, replace(rt.settings, registry=capped))
    advertise(rt, "gpu.audio", "gpu.image")
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "b", ["image"])  # one runs, two wait
    use_settings(rt, replace(rt.settings, registry=replace(capped, stages=(capped.get("audio"),))))  # image gone
    for bucket in ("capacity", "idempotent"):
        rt.redis.client.delete(rt.redis.keys.deferrals("b", bucket))
    gate.gate_pass(rt.ports, "b")
    assert list(states(rt, "b").values()).count("pending") == 2  # they wait, their command still active
    assert rt.redis.client.zscore(rt.redis.keys.due(), "b") is None


def test_a_pass_on_a_stale_snapshot_never_puts_a_book_due_now_further_back(rt: Wiring) -> None:
    """A pass writes the book's next due time from the due entry its snapshot read. A job that ended meanwhile made
    the book due now; the pass then wrote its later time over that (the book waited up to a capacity deferral,
    a minute), or, finding nothing more to do, took the book off the index (it waited for reconcile)."""
    from animastor_tasks.flow import page

    now = rt.ports.clock()
    key = rt.redis.keys.due()
    rt.ports.book_state.set_due("b", now)  # a job ended: the book is due now
    page.write_due(rt.ports, "b", now + 30, now + 60)  # a pass whose snapshot saw it due in a minute
    assert rt.redis.client.zscore(key, "b") == now
    page.write_due(rt.ports, "b", None, now + 60)  # a pass that found nothing more, on the same snapshot
    assert rt.redis.client.zscore(key, "b") == now
    page.write_due(rt.ports, "b", None, now)  # one that saw the entry as it is: the book leaves the index
    assert rt.redis.client.zscore(key, "b") is None


def test_a_book_made_active_while_a_pass_finds_it_idle_stays_on_the_due_index(rt, monkeypatch) -> None:
    """The pass read that the book had no active scene, reconcile (or a regenerate) then put a scene in and the
    book on the due index, and the pass took the book off both: its pending work waited, unvisited by the tick,
    until reconcile's round came back to it."""
    store, client = rt.ports.book_state, rt.redis.client
    real_scard = client.scard
    activated: list[bool] = []

    def scard_then_activate(key: str) -> int:
        found = real_scard(key)
        store.activate({"b": [("ch1", "s1")]})  # another process, between the read and the removal
        activated.append(True)
        return found

    monkeypatch.setattr(client, "scard", scard_then_activate)
    store.drop_book_if_idle("b")
    monkeypatch.undo()
    if not activated:
        store.activate({"b": [("ch1", "s1")]})  # one step: it comes wholly before or after
    assert client.zscore(rt.redis.keys.due(), "b") is not None
    assert "b" in store.active_books()


def test_a_book_with_an_active_scene_is_left_active_and_due(rt) -> None:
    store, client = rt.ports.book_state, rt.redis.client
    store.activate({"b": [("ch1", "s1")]})
    store.drop_book_if_idle("b")
    assert client.zscore(rt.redis.keys.due(), "b") is not None and "b" in store.active_books()
    client.delete(rt.redis.keys.active_scenes("b"))  # its last scene done
    store.drop_book_if_idle("b")
    assert client.zscore(rt.redis.keys.due(), "b") is None and "b" not in store.active_books()


def test_a_book_that_goes_idle_takes_its_deferrals_with_it(rt) -> None:
    """Reconcile prunes deferrals of active books only: every book that finished kept its sets in Redis for ever."""
    store, client = rt.ports.book_state, rt.redis.client
    rt.ports.deferrals.defer("b", "capacity", [("ch1", "s1", "audio")], 60, rt.redis.server_time())
    rt.ports.deferrals.defer("b", "idempotent", [("ch1", "s2", "audio")], 600, rt.redis.server_time())
    rt.ports.deferrals.defer("other", "capacity", [("ch1", "s1", "audio")], 60, rt.redis.server_time())
    store.activate({"b": [("ch1", "s1")]})
    store.drop_book_if_idle("b")
    assert client.exists(rt.redis.keys.deferrals("b", "capacity"), rt.redis.keys.deferrals("b", "idempotent")) == 2
    client.delete(rt.redis.keys.active_scenes("b"))  # its last scene done
    store.drop_book_if_idle("b")
    assert client.exists(rt.redis.keys.deferrals("b", "capacity"), rt.redis.keys.deferrals("b", "idempotent")) == 0
    assert client.exists(rt.redis.keys.deferrals("other", "capacity")) == 1


def test_a_regenerate_whose_first_pass_fails_leaves_its_book_due(rt, monkeypatch) -> None:
    """The new work reached the due index only through the first pass's end: a pass that could not read the book's
    rows (or a process that died before it) left the book off the tick's index until reconcile's round came to it."""
    from animastor_tasks.errors import StoreUnavailable

    from .helpers import advertise, make_book

    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")

    def unreadable(*_: object, **__: object) -> None:
        raise StoreUnavailable("postgres", rt.settings.database_url, "connection reset")

    monkeypatch.setattr(rt.ports.assets, "gate_rows_many", unreadable)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    monkeypatch.undo()
    assert rt.redis.client.zscore(rt.redis.keys.due(), "b") is not None
    rt.redis.client.delete(rt.redis.keys.lock("tick"))
    assert "b" in gate.tick(rt.ports)


def test_a_book_waiting_for_an_open_breaker_is_not_passed_on_every_tick_and_goes_at_once_when_it_closes(rt) -> None:
    """Its pairs refused by the open breaker had no deferral: the pass made the book due now, and each tick (5 s)
    passed it again, reading all its pairs in flight, for as long as the breaker stayed open (a backend outage:
    it reopens after each failed test). 100 books of 1000 pairs each cost 1-2 s a tick."""
    lane(rt, lane_limit=2, book_quota=2, window=4)
    use_settings(rt, replace(rt.settings, breaker_threshold=1, breaker_cooldown_seconds=60))
    advertise(rt, "gpu.audio", "gpu.image")
    rt.catalog.import_book(make_book("a", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("w", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    assert rt.ports.breaker.breaker_record_run("gpu.audio", False, 1, 60, None).state == "open"  # another job's failure
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])  # its pass: refused by the breaker
    opened_until = float(rt.redis.client.hget(rt.redis.keys.breaker("gpu.audio"), "open_until"))
    assert rt.redis.client.zscore(rt.redis.keys.due(), "w") == pytest.approx(opened_until, abs=0.5)
    assert tick(rt) == []  # not due before the cool-down ends
    rt.ports.book_state.set_due("w", 0.0)  # a job's end (or reconcile) asked for a pass: same answer
    assert tick(rt) == ["w"]
    gate.gate_pass(rt.ports, "w")
    assert tick(rt) == []
    assert rt.redis.client.zscore(rt.redis.keys.due(), "w") == pytest.approx(opened_until, abs=0.5)
    run_control(rt)
    finish_one(rt, "a")  # runs well: the breaker closes, and the book waiting for it goes at once
    assert rt.breaker.breaker_state("gpu.audio") == "closed"
    assert running(rt, "w") == {"w": 2}
