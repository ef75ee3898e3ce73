"""Dispatch order, deferral costs, breaker, fairness, sweep and reconcile on real stores."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest

from animastor_tasks.domain.deferral import wait_score
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.vocabulary import Outcome, Priority, priority_rank
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, lanes, refill
from animastor_tasks.flow import layers as layers_flow
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, fake_artifact, lose_leases, make_book, queued_messages, states, use_settings

WRITE_COMMANDS = {
    "SET",
    "DEL",
    "UNLINK",
    "ZADD",
    "ZREM",
    "ZREMRANGEBYSCORE",
    "SADD",
    "SREM",
    "HSET",
    "HINCRBY",
    "EXPIRE",
    "PEXPIRE",
    "EVALSHA",
    "EVAL",
    "INCR",
    "LPUSH",
    "RPUSH",
}


class CommandLog:
    """Counts the Redis commands this process sends (pipelines included)."""

    def __init__(self, rt: Wiring, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: Counter[str] = Counter()
        self.round_trips = 0
        client = rt.redis.client
        original = client.execute_command
        original_pipeline = client.pipeline

        def execute_command(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls[str(args[0]).upper()] += 1
            self.round_trips += 1
            return original(*args, **kwargs)

        def pipeline(*args, **kwargs):  # type: ignore[no-untyped-def]
            pipe = original_pipeline(*args, **kwargs)
            run = pipe.execute

            def execute(*a, **k):  # type: ignore[no-untyped-def]
                for command_args, _ in pipe.command_stack:
                    self.calls[str(command_args[0]).upper()] += 1
                self.round_trips += 1
                return run(*a, **k)

            pipe.execute = execute
            return pipe

        monkeypatch.setattr(client, "execute_command", execute_command)
        monkeypatch.setattr(client, "pipeline", pipeline)

    def writes(self) -> int:
        return sum(n for name, n in self.calls.items() if name in WRITE_COMMANDS)


def pg_snapshot(rt: Wiring) -> tuple[int, list[tuple]]:
    with rt.db.transaction() as conn:
        events = conn.execute("SELECT count(*) FROM events").fetchone()[0]
        rows = conn.execute(
            "SELECT book_id, chapter_id, scene_id, stage, state, fencing_token, updated_at FROM asset_states"
            " ORDER BY 1, 2, 3, 4"
        ).fetchall()
    return events, rows


def test_deferred_pairs_cost_one_read_and_no_write(rt, monkeypatch) -> None:
    """1,000 deferred pairs over 10 passes: 0 writes, <= 1 Redis read per pair per pass."""
    rt.catalog.import_book(make_book("big", chapters=10, scenes=50))
    advertise(rt, "gpu.audio", "gpu.image")
    regenerate_flow.regenerate(rt.ports, "big", ["all"])
    # Everything beyond the first dispatches is now deferred (quota/window/lane: capacity bucket).
    with rt.db.transaction() as conn:
        conn.execute("UPDATE asset_states SET state = 'pending' WHERE book_id = 'big' AND state = 'generating'")
    pending = [(c, s, st) for (c, s, st), state in states(rt, "big").items() if state == "pending"]
    rt.deferrals.defer("big", "capacity", pending, 60, time.time())
    assert len(pending) == 1000
    before = pg_snapshot(rt)
    rt.counters.flush()  # the regenerate's counts out now, not by the writer thread amid the passes
    log = CommandLog(rt, monkeypatch)
    for _ in range(10):
        report = gate.gate_pass(rt.ports, "big")
        assert report.outcomes == Counter({Outcome.DEFERRED: 1000})
    assert log.writes() == 0, log.calls
    assert log.round_trips <= 10 * 1000  # far below: one pipeline per pass
    assert log.round_trips <= 10 * 2, log.calls
    assert pg_snapshot(rt) == before  # no lease, no FSM write, no journal event


def test_capacity_outcomes_defer_sixty_seconds_and_completion_frees_them(rt) -> None:
    spec = replace(rt.settings.registry.get("audio"), book_cap=4)
    use_settings(rt, replace(rt.settings, registry=replace(rt.settings.registry, stages=(spec,))))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    found = states(rt, "b")
    assert sum(1 for v in found.values() if v == "generating") == 4  # book cap
    key = rt.redis.keys.deferrals("b", "capacity")
    deferred = rt.redis.client.zrange(key, 0, -1, withscores=True)
    assert {m for m, _ in deferred} == {"ch1:s5:audio", "ch1:s6:audio"}
    assert all(55 < score - rt.ports.clock() <= 60 for _, score in deferred)  # the runtime's clock, not this host's


def _one_audio_job(rt) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """Book "b" of one scene, its audio regenerated: the dispatched job's token and dispatch id."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    with rt.db.transaction() as conn:
        return conn.execute(
            "SELECT fencing_token, dispatch_id FROM asset_states WHERE book_id = 'b' AND stage = 'audio'"
        ).fetchone()


def test_a_commit_sent_again_after_it_landed_is_answered_as_committed(rt) -> None:
    """A commit whose answer was lost with its connection (a failover) is sent again by its job. The pair is
    `ready` already, so the compare matched nothing, and the job called its own committed output discarded:
    reported `fence_rejected`, its freed slot never handed on."""
    token, dispatch_id = _one_audio_job(rt)
    artifact = fake_artifact("a")
    pair = ("ch1", "s1", "audio")
    assert rt.ports.jobs.commit_job("b", pair, token, dispatch_id, artifact, "gpu.audio")
    assert rt.ports.jobs.commit_job("b", pair, token, dispatch_id, artifact, "gpu.audio")
    with rt.db.transaction() as conn:
        assert conn.execute("SELECT count(*) FROM artifacts WHERE dispatch_id = %s", (dispatch_id,)).fetchone() == (1,)
    assert not rt.ports.jobs.commit_job("b", pair, token, "another-dispatch", fake_artifact("b"), "gpu.audio")


def test_already_completed_is_idempotent_without_force(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s1"]])
    with rt.db.transaction() as conn:
        token, dispatch_id = conn.execute(
            "SELECT fencing_token, dispatch_id FROM asset_states WHERE book_id = 'b' AND chapter_id = 'ch1'"
            " AND scene_id = 's1' AND stage = 'audio'"
        ).fetchone()
    artifact = fake_artifact("a")
    assert rt.ports.jobs.commit_job("b", ("ch1", "s1", "audio"), token, dispatch_id, artifact, "gpu.audio")
    published = queued_messages(rt, "gpu.audio")
    report = regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s1"]], force=False)
    assert report["commands"][0]["status"] == "completed"  # settled by the pass, before the answer
    assert states(rt, "b")[("ch1", "s1", "audio")] == "ready"
    assert queued_messages(rt, "gpu.audio") == published  # nothing new published
    # Settled, the pair is in flight no more, and the book, with nothing else in flight, leaves the active index
    # with its deferrals. *Why:* kept there, counted busy, it stayed for good (neither the tick nor reconcile
    # visits a book with no work), its idempotent deferral with it.
    assert "b" not in rt.ports.book_state.active_books()
    keys = rt.redis.keys
    assert rt.redis.client.exists(keys.active_scenes("b"), keys.deferrals("b", "idempotent")) == 0
    # With force (the default) the same pair is generated again.
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s1"]])
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"


def test_a_deferral_a_pass_writes_after_a_stop_all_ends_with_its_key(rt) -> None:
    """A pass that read its book before a Stop All wrote its deferrals after the Stop All had deleted them: the book,
    off the active index and the due index, is visited by nobody, and its deferral key stayed for good (one per
    such race in a soak). A deferral key lives as long as the deferral written last, and a minute more."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    cancel_flow.cancel(rt.ports, "b")
    now = rt.ports.clock()
    rt.ports.deferrals.defer("b", "capacity", [("ch1", "s2", "audio")], 60, now)  # the late pass's write
    key = rt.redis.keys.deferrals("b", "capacity")
    assert "b" not in rt.ports.book_state.active_books()
    assert 60 < rt.redis.client.ttl(key) <= 120
    rt.ports.deferrals.defer("b", "capacity", [("ch1", "s1", "audio")], 5, now)  # a later, shorter one
    assert 5 < rt.redis.client.ttl(key) <= 65


def test_no_consumer_blocks_the_command_and_publishes_nothing(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    advertise(rt, "gpu.audio")  # no image consumer
    result = regenerate_flow.regenerate(rt.ports, "b", ["all"])
    assert len(result["commands"]) == 2
    by_stage = {c.stage: c for c in rt.ports.commands.commands(book="b")}
    assert by_stage["image"].status == "blocked" and by_stage["image"].reason == "no_worker:image"
    assert by_stage["audio"].status == "active"
    assert queued_messages(rt, "gpu.image") == 0 and queued_messages(rt, "gpu.audio") == 3
    assert {st for (_, _, stage), st in states(rt, "b").items() if stage == "image"} == {"dirty"}
    # No retry: later passes leave the blocked command alone.
    gate.gate_pass(rt.ports, "b")
    assert queued_messages(rt, "gpu.image") == 0
    # A worker appears and a new command runs.
    advertise(rt, "gpu.image", host="image@local")
    regenerate_flow.regenerate(rt.ports, "b", ["image"])
    assert queued_messages(rt, "gpu.image") == 3


def test_the_books_of_a_stage_without_a_worker_are_blocked_after_one_recount_not_one_each(rt, monkeypatch) -> None:
    """Each pass of a book with work on a stage whose only worker died counted its consumers again a heartbeat
    later (a sleep of 2.5 s), one book after another: 100 due books held both control processes for two minutes.
    A double count stands for the passes that follow it within a presence TTL."""
    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(lanes.time, "sleep", lambda seconds: (slept.append(seconds), real_sleep(seconds)))
    advertise(rt, "gpu.audio")  # no image consumer
    for book in ("b1", "b2", "b3"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
        regenerate_flow.regenerate(rt.ports, book, ["image"])
    assert [c.status for b in ("b1", "b2", "b3") for c in rt.ports.commands.commands(book=b)] == ["blocked"] * 3
    assert len(slept) == 1, slept
    advertise(rt, "gpu.image", host="image@local")  # a worker back: counted by the pass, no note stands for it
    regenerate_flow.regenerate(rt.ports, "b1", ["image"])
    assert queued_messages(rt, "gpu.image") == 1


def test_a_note_of_no_consumer_stands_for_no_worker_that_beats_now(rt) -> None:
    """A pass judging from a snapshot read before a worker came back (a batch reads ten books ahead) found the
    queue noted without a consumer moments ago and BLOCKED its commands for good: a note stands only beside a
    count of none made now."""
    rt.presence.note_unconsumed(["gpu.image"])
    advertise(rt, "gpu.image", host="image@back")
    assert lanes.gone_for_good(rt.ports, ["gpu.image"]) == set()


def test_expired_presence_counts_as_no_consumer(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio", ttl=0.2)
    time.sleep(0.3)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert rt.ports.commands.commands(book="b")[0].status == "blocked"


def test_an_unused_half_open_permit_is_given_back_within_the_pass(rt) -> None:
    """The test permit of a half-open breaker whose pass had no room to use it is released at once,
    not held for its lease: the next pass can test the queue."""
    spec = rt.settings.registry.get("audio")
    use_settings(
        rt,
        replace(
            rt.settings,
            breaker_threshold=1,
            breaker_cooldown_seconds=30,
            registry=replace(rt.settings.registry, stages=(replace(spec, lane_limit=1),)),
        ),
    )
    for book in ("a", "b"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])  # takes the lane's only slot
    assert states(rt, "a")[("ch1", "s1", "audio")] == "generating"
    rt.breaker.breaker_record("gpu.audio", False, 1, 0.2)  # open, cool-down 0.2 s
    time.sleep(0.3)
    report = regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # half-open: a permit, but no room
    assert report["commands"][0]["status"] == "active"
    assert Counter(states(rt, "b").values()) == {"pending": 1}
    assert rt.breaker.breaker_acquire("gpu.audio", 30) == "permit"  # given back, not held for 30 s


def test_circuit_breaker_opens_gives_one_permit_and_closes(rt, monkeypatch) -> None:
    use_settings(rt, replace(rt.settings, breaker_threshold=2, breaker_cooldown_seconds=0.5))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=4))
    advertise(rt, "gpu.audio")
    publisher = rt.ports.publisher
    calls: list[str] = []

    def failing(task_name, queue, dispatch_id, kwargs):  # type: ignore[no-untyped-def]
        calls.append(dispatch_id)
        raise ConnectionError("broker refused")

    monkeypatch.setattr(publisher, "publish_job", failing)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert rt.breaker.breaker_state("gpu.audio") == "open"
    assert set(states(rt, "b").values()) >= {"pending"} and "generating" not in states(rt, "b").values()
    failed_attempts = len(calls)
    report = gate.gate_pass(rt.ports, "b")
    assert report.outcomes[Outcome.BREAKER_OPEN] == 4 and len(calls) == failed_attempts  # refused while open
    time.sleep(0.6)
    monkeypatch.undo()
    advertise(rt, "gpu.audio")
    report = gate.gate_pass(rt.ports, "b")
    assert report.outcomes[Outcome.DISPATCHED] == 1  # exactly one test permit when half-open
    assert rt.breaker.breaker_state("gpu.audio") == "closed"
    report = gate.gate_pass(rt.ports, "b")
    assert report.outcomes[Outcome.DISPATCHED] == 3


def test_a_pair_whose_publish_failed_waits_and_its_book_stays_due(rt, monkeypatch) -> None:
    """A failed publish puts the pair back to `pending`, but the pass counted it gone (claimed): with nothing
    else waiting the book left the due index, and the pair waited for reconcile to find the book again."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")

    def failing(task_name, queue, dispatch_id, kwargs):  # type: ignore[no-untyped-def]
        raise ConnectionError("broker refused")

    monkeypatch.setattr(rt.ports.publisher, "publish_job", failing)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s1"]])
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"
    due = rt.redis.client.zscore(rt.redis.keys.due(), "b")
    assert due is not None and due <= rt.ports.clock()  # written by the runtime's (Redis's) clock
    monkeypatch.undo()
    assert gate.tick(rt.ports) == ["b"]  # the next tick passes it again
    gate.gate_batch(rt.ports, ["b"])
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"


def test_a_failed_publish_whose_breaker_record_fails_too_still_undoes_its_claim_and_publishes_the_rest(
    rt, monkeypatch
) -> None:
    """Old code: the broker (the same Redis, blipping) refused the first job, recording the failure against the
    breaker raised too, and the pass stopped there: the refused pair stayed `generating` under a day-long queued
    lease with no message, and the next pair was never published, both until reconcile asked the broker."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    publish = rt.ports.publisher.publish_job
    refused: list[str] = []

    def first_refused(task_name, queue, dispatch_id, kwargs):  # type: ignore[no-untyped-def]
        if not refused:
            refused.append(kwargs["scene_id"])
            raise ConnectionError("broker refused")
        return publish(task_name, queue, dispatch_id, kwargs)

    def breaker_down(*args: object, **kwargs: object) -> str:
        raise StoreUnavailable("redis", rt.settings.redis_url, "connection reset")

    monkeypatch.setattr(rt.ports.publisher, "publish_job", first_refused)
    monkeypatch.setattr(rt.ports.breaker, "breaker_record", breaker_down)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    other = "s2" if refused == ["s1"] else "s1"
    assert states(rt, "b")[("ch1", refused[0], "audio")] == "pending"
    assert states(rt, "b")[("ch1", other, "audio")] == "generating"
    assert rt.redis.client.get(rt.redis.keys.lease("b", "ch1", refused[0], "audio")) is None


def test_a_refill_whose_publish_failed_leaves_its_book_due_for_the_next_tick(rt, monkeypatch) -> None:
    """As above, through a refill (a freed slot): old code wrote no due time there, and the pair (and its slot)
    waited for reconcile to find the book again."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")

    def failing(task_name, queue, dispatch_id, kwargs):  # type: ignore[no-untyped-def]
        raise ConnectionError("broker refused")

    monkeypatch.setattr(rt.ports.publisher, "publish_job", failing)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s1"]])  # its full pass leaves the book due
    rt.redis.client.zrem(rt.redis.keys.due(), "b")  # passed by the tick since, the publish failing again
    refill.refill(rt.ports, "b", "gpu.audio")  # a slot of the lane freed meanwhile
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"
    due = rt.redis.client.zscore(rt.redis.keys.due(), "b")
    assert due is not None and due <= rt.ports.clock()  # written by the runtime's (Redis's) clock
    monkeypatch.undo()
    assert gate.tick(rt.ports) == ["b"]
    gate.gate_batch(rt.ports, ["b"])
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"


class CommitRefused:
    """The real asset store, whose next claim transaction fails at its end (as a COMMIT Postgres refuses)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.armed = inner, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextmanager
    def claiming(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with self.inner.claiming(*args, **kwargs) as session:
            yield session
            if self.armed:
                self.armed = False
                raise StoreUnavailable("postgres", "test", "commit refused")


def test_a_claim_that_did_not_commit_leaves_no_lease_to_hold_its_pair(rt) -> None:
    """The claim's leases are written before its COMMIT: one the database refused left a lease of a dispatch
    that never was, and every later pass skipped the pair as claimed by a concurrent pass (for 24 h)."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    pair = ("ch1", "s1", "audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    with rt.db.read() as conn:
        token, dispatch_id = conn.execute(
            "SELECT fencing_token, dispatch_id FROM asset_states WHERE book_id = 'b' AND scene_id = 's1'"
            " AND stage = 'audio'"
        ).fetchone()
    assert rt.ports.jobs.commit_job("b", pair, token, dispatch_id, fake_artifact("a"), "gpu.audio")
    rt.ports.leases.release_lease(("b", *pair), dispatch_id)  # the job's end
    ports = rt.ports
    rt.ports = replace(ports, assets=CommitRefused(ports.assets))
    with pytest.raises(StoreUnavailable):
        regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # its pass's claim is refused at COMMIT
    assert states(rt, "b")[pair] == "pending"
    assert rt.ports.leases.lease_holders([("b", *pair)]) == [None]
    rt.ports = ports
    gate.gate_pass(rt.ports, "b")
    assert states(rt, "b")[pair] == "generating"


def test_a_claim_commits_without_waiting_for_its_flush_and_the_start_it_leads_to_waits_for_both(rt) -> None:
    """A claim's commit skips the WAL flush (a millisecond on every dispatch); what makes it safe is that a job
    runs only past its start check, whose commit is synchronous and so flushes the claim written before it."""
    _one_audio_job(rt)
    with rt.ports.assets.claiming("b", {"audio": "gpu.audio"}) as session:
        claim_setting = session._conn.execute("SELECT current_setting('synchronous_commit')").fetchone()[0]
    with rt.ports.jobs.starting("b", ("ch1", "s1", "audio")) as start:
        start_setting = start._conn.execute("SELECT current_setting('synchronous_commit')").fetchone()[0]
    with rt.db.read() as conn:  # the pool's connections keep the server's default after the claim
        later = {conn.execute("SELECT current_setting('synchronous_commit')").fetchone()[0] for _ in range(3)}
    assert (claim_setting, start_setting, later) == ("off", "on", {"on"})


def test_a_lane_whose_breaker_is_open_keeps_its_waiting_list(rt) -> None:
    """A pass that claimed for another stage counted the open lane too and handed its spare slots to the books
    waiting for it: each found the breaker open, and the lane's waiting list emptied, its order lost."""
    use_settings(rt, replace(rt.settings, breaker_threshold=1, breaker_cooldown_seconds=60))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    advertise(rt, "gpu.image")
    assert rt.ports.breaker.breaker_record_run("gpu.audio", False, 1, 60, None).state == "open"
    for score, waiter in enumerate(("first", "second")):
        rt.ports.deferrals.wait_for_lane("gpu.audio", waiter, score)
    regenerate_flow.regenerate(rt.ports, "b", ["audio", "image"])
    assert Counter((p[2], v) for p, v in states(rt, "b").items()) == {
        ("audio", "pending"): 2,
        ("image", "generating"): 2,
    }
    # b's audio pairs wait for the breaker, so b waits for the lane too, behind the books that waited longer.
    assert rt.redis.client.zrange(rt.redis.keys.lane_waiters("gpu.audio"), 0, -1) == ["first", "second", "b"]
    assert queued_messages(rt, "animastor.control") == 0  # no refill sent to a waiter
    # Nor does a slot of the lane handed on elsewhere (a job that gave its pair back as the breaker opened, a
    # recount) take a waiter while it is open; once its cooldown is over, one does (the half-open test).
    assert lanes.hand_over(rt.ports, "gpu.audio", 2) == []
    assert rt.redis.client.zrange(rt.redis.keys.lane_waiters("gpu.audio"), 0, -1) == ["first", "second", "b"]
    breaker = rt.redis.keys.breaker("gpu.audio")
    rt.redis.client.hset(breaker, mapping={"open_until": time.time() - 1, "permit_until": time.time() + 60})
    assert lanes.hand_over(rt.ports, "gpu.audio", 1) == []  # half-open, its one test permit out: still open
    rt.redis.client.hdel(breaker, "permit_until")
    assert lanes.hand_over(rt.ports, "gpu.audio", 1) == ["first"]


def test_two_books_share_a_lane_without_waiting_for_each_other(rt) -> None:
    for b in ("first", "second"):
        rt.catalog.import_book(make_book(b, chapters=2, scenes=10))
    advertise(rt, "gpu.audio")
    # Both ask before either pass runs: `second` already waits for the lane when `first` is passed, so
    # the fair share (quota 4) binds `first` and leaves the other half of the lane to `second`.
    rt.ports.deferrals.wait_for_lane("gpu.audio", "second", wait_score(priority_rank(Priority.NORMAL), 0.0))
    regenerate_flow.regenerate(rt.ports, "first", ["audio"])
    regenerate_flow.regenerate(rt.ports, "second", ["audio"])
    running = Counter(b for b in ("first", "second") for v in states(rt, b).values() if v == "generating")
    assert running == {"first": 4, "second": 4}  # lane 8, quota 4 each: neither book starves


def test_lane_limit_holds_under_concurrent_passes(rt) -> None:
    spec = rt.settings.registry.get("audio")
    use_settings(
        rt,
        replace(
            rt.settings,
            registry=replace(rt.settings.registry, stages=(replace(spec, lane_limit=3, book_quota=3, window=10),)),
        ),
    )
    for b in ("x", "y", "z"):
        rt.catalog.import_book(make_book(b, chapters=1, scenes=5))
    advertise(rt, "gpu.audio")
    for b in ("x", "y", "z"):
        regenerate_flow.regenerate(rt.ports, b, ["audio"])
    total = sum(1 for b in ("x", "y", "z") for v in states(rt, b).values() if v == "generating")
    assert total == 3


def test_cancel_sweeps_only_its_own_book(rt) -> None:
    for b in ("mine", "theirs"):
        rt.catalog.import_book(make_book(b, chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "mine", ["audio"])
    regenerate_flow.regenerate(rt.ports, "theirs", ["audio"])
    leases_before = {b: rt.ports.leases.lease_holders([(b, "ch1", "s1", "audio")])[0] for b in ("mine", "theirs")}
    out = cancel_flow.cancel(rt.ports, "mine")
    assert out["revoked"] == 2
    assert rt.ports.leases.lease_holders([("mine", "ch1", "s1", "audio")]) == [None]
    assert rt.ports.leases.lease_holders([("theirs", "ch1", "s1", "audio")]) == [leases_before["theirs"]]
    assert set(states(rt, "theirs").values()) == {"generating", "dirty"}


def test_reconcile_returns_a_dead_lease_to_pending_once_and_fences_the_stale_job(rt) -> None:
    token, dispatch_id = _one_audio_job(rt)
    rt.redis.client.delete("gpu.audio")  # a worker took the job and died with it
    lose_leases(rt, [("b", "ch1", "s1", "audio")])
    report = reconcile_flow.reconcile(rt.ports, force=True)
    assert report["expired"] == 1
    assert reconcile_flow.reconcile(rt.ports, force=True)["expired"] == 0  # once
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"
    gate.gate_pass(rt.ports, "b")  # re-dispatched with a new token
    artifact = fake_artifact("b")
    assert not rt.ports.jobs.commit_job("b", ("ch1", "s1", "audio"), token, dispatch_id, artifact, "gpu.audio")


def test_reconcile_rebuilds_redis_after_flushall_without_unauthorized_work(rt) -> None:
    for b in ("live", "stopped", "idle"):
        rt.catalog.import_book(make_book(b, chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "live", ["audio"])
    regenerate_flow.regenerate(rt.ports, "stopped", ["audio"])
    cancel_flow.cancel(rt.ports, "stopped")
    layers_flow.set_layers(rt.ports, "live", [], ["image"])
    rt.redis.client.flushdb()  # this test's own db: FLUSHALL would wipe every other user of the server
    advertise(rt, "gpu.audio")
    reconcile_flow.reconcile(rt.ports, force=True)
    assert rt.ports.book_state.active_books() == {"live"}
    assert rt.ports.book_state.cancel_flag_set("stopped") and not rt.ports.book_state.cancel_flag_set("live")
    # The leases died with Redis: the pairs are pending again (still authorized), then dispatched anew.
    assert set(v for (_, _, st), v in states(rt, "live").items() if st == "audio") == {"pending"}
    for book in sorted(rt.ports.book_state.active_books()):
        gate.gate_pass(rt.ports, book)
    assert set(v for (_, _, st), v in states(rt, "live").items() if st == "audio") == {"generating"}
    assert set(states(rt, "stopped").values()) == {"dirty"} and set(states(rt, "idle").values()) == {"dirty"}


def test_presence_registry_down_dispatches_nothing(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")

    def unreadable(queues, heartbeats=None):  # type: ignore[no-untyped-def]
        from animastor_tasks.errors import StoreUnavailable

        raise StoreUnavailable("redis", "redis://127.0.0.1:1/0", "connection refused")

    rt.presence.counts = unreadable  # type: ignore[method-assign]
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"
    assert queued_messages(rt, "gpu.audio") == 0


def test_a_third_stage_runs_through_the_same_path(rt) -> None:
    from celery import Celery

    from animastor_tasks.adapters.celery_publisher import CeleryPublisher
    from animastor_tasks.worker.celery_config import build_config

    video = StageSpec(name="video", queue="gpu.video", input_field="prompt", media_type="video/mp4")
    settings = replace(rt.settings, registry=replace(rt.settings.registry, stages=(*rt.settings.stages, video)))
    rt.catalog.registry = settings.registry
    app = Celery("video-test")
    app.conf.update(build_config(settings))
    ports = replace(rt.ports, settings=settings, publisher=CeleryPublisher(app, rt.counters))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.video")
    regenerate_flow.regenerate(ports, "b", ["video"])
    assert queued_messages(rt, "gpu.video") == 2


def test_a_pending_pair_still_leased_is_already_generating_unless_forced(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=False)
    # Both pairs were dispatched; put them back to pending while their leases live on (a stale dispatch).
    with rt.db.transaction() as conn:
        conn.execute("UPDATE asset_states SET state = 'pending' WHERE book_id = 'b' AND stage = 'audio'")
    report = gate.gate_pass(rt.ports, "b")
    assert report.outcomes[Outcome.ALREADY_GENERATING] == 2 and report.dispatched == []
    idem = rt.redis.client.zrange(rt.redis.keys.deferrals("b", "idempotent"), 0, -1)
    assert sorted(idem) == ["ch1:s1:audio", "ch1:s2:audio"]
    # A forced pair pre-clears exactly its own stale lease and is dispatched again.
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s1"]])
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"
    assert states(rt, "b")[("ch1", "s2", "audio")] == "pending"


def test_a_pass_on_facts_read_before_a_concurrent_claim_does_not_claim_the_pair_again(rt) -> None:
    """A pair with another dispatch's lease is no longer skipped on sight (tests/integration/test_regenerate_running.py:
    such a lease may be a stray one); a real concurrent claim is caught under the book's lock."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio", ttl=3600)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    with rt.db.transaction() as conn:  # the pair pending again with its first dispatch on record, as after a re-make
        conn.execute("UPDATE asset_states SET state = 'pending' WHERE book_id = 'b' AND stage = 'audio'")
    lose_leases(rt, [("b", "ch1", "s1", "audio")])
    rt.redis.client.delete("gpu.audio")
    stale = (gate._snapshot(rt.ports, "b", rt.ports.clock()), rt.ports.assets.gate_rows_many(["b"], limit=100)["b"])
    first = gate.gate_pass(rt.ports, "b")
    assert len(first.dispatched) == 1
    late = gate.gate_pass(rt.ports, "b", known=stale)
    assert late.dispatched == [] and queued_messages(rt, "gpu.audio") == 1
    [holder] = rt.ports.leases.lease_holders([("b", "ch1", "s1", "audio")])
    assert holder is not None and states(rt, "b")[("ch1", "s1", "audio")] == "generating"


def test_a_job_still_queued_keeps_its_pair_past_the_lease(rt) -> None:
    """Waiting in the broker queue is live evidence: reconcile restores the lease, it does not re-dispatch."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert queued_messages(rt, "gpu.audio") == 1
    lose_leases(rt, [("b", "ch1", "s1", "audio")])
    assert reconcile_flow.reconcile(rt.ports, force=True)["expired"] == 0
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"
    assert rt.ports.leases.lease_holders([("b", "ch1", "s1", "audio")]) != [None]
    # Once the message is gone (lost with a broker flush), the pair goes back to pending.
    rt.redis.client.delete("gpu.audio")
    lose_leases(rt, [("b", "ch1", "s1", "audio")])
    assert reconcile_flow.reconcile(rt.ports, force=True)["expired"] == 1
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"


def test_reconcile_blocks_jobs_queued_on_a_queue_that_lost_every_consumer(rt) -> None:
    from animastor_tasks.flow.generate import run_job
    from animastor_tasks.flow.job import Job

    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.image", ttl=0.3)
    regenerate_flow.regenerate(rt.ports, "b", ["image"])
    assert queued_messages(rt, "gpu.image") == 2
    with rt.db.transaction() as conn:
        jobs = conn.execute(
            "SELECT chapter_id, scene_id, stage, dispatch_id, fencing_token FROM asset_states"
            " WHERE state = 'generating'"
        ).fetchall()
    time.sleep(0.4)  # the only consumer's heartbeat expires
    report = reconcile_flow.reconcile(rt.ports, force=True)
    assert report["blocked"] == 1
    [command] = rt.ports.commands.commands(book="b")
    assert (command.status, command.reason) == ("blocked", "no_worker:image")
    assert set(states(rt, "b").values()) == {"dirty"}
    # The messages still in the queue are harmless: a worker that picks one up later refuses it.
    for c, s, st, d, t in jobs:
        assert run_job(rt.ports, Job("b", c, s, st, d, t), worker="late")["outcome"] == "fence_rejected"


def test_lane_waiters_are_served_oldest_first_and_each_once(rt) -> None:
    waiters = rt.deferrals
    for i, book in enumerate(["x", "y", "z"]):
        waiters.wait_for_lane("gpu.audio", book, 100 + i)
    waiters.wait_for_lane("gpu.audio", "x", 999)  # already waiting: keeps its place
    assert waiters.next_waiters("gpu.audio", 2, exclude="y") == ["x", "z"]
    assert waiters.next_waiters("gpu.audio", 5) == ["y"]
    assert waiters.next_waiters("gpu.audio", 5) == []


def test_a_replacement_publish_does_not_hide_the_failures_of_runs(rt) -> None:
    """Run failures count towards the threshold even while replacement jobs publish fine; a run that
    succeeds clears them, a publish that succeeds does not."""
    use_settings(rt, replace(rt.settings, breaker_threshold=2, breaker_cooldown_seconds=30))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    advertise(rt, "gpu.audio")
    breaker = rt.breaker
    assert breaker.breaker_record_run("gpu.audio", False, 2, 30, None).state == "closed"  # one failed run
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # publishes fine: the failure must stay counted
    assert Counter(states(rt, "b").values())["generating"] == 3
    assert breaker.breaker_record_run("gpu.audio", False, 2, 30, None).state == "open"  # the second failed run
    assert breaker.breaker_state("gpu.audio") == "open"
    breaker.breaker_record("gpu.audio", True, 2, 30)  # a publish succeeding proves nothing about runs
    assert breaker.breaker_state("gpu.audio") == "open"
    breaker.breaker_record_run("gpu.audio", True, 2, 30, None)  # a run succeeding does
    assert breaker.breaker_state("gpu.audio") == "closed"


def test_a_dispatched_job_carries_no_time_limits_of_its_sender(rt) -> None:
    """Celery's send_task puts the sending process's own limits for the task into the message (`timelimit`), and the
    GPU worker applies them over its own: a job ran under the control host's ANIMASTOR_JOB_*TIME_LIMIT, not its GPU
    host's (a hunt: limits of 60/75 s on the GPU worker, a job ran 82 s uncut under the control worker's 120/150)."""
    import base64
    import json

    import redis

    from animastor_tasks.worker import tasks

    assert rt.settings.registry.get("audio").task_name in tasks.app.tasks  # registered here, with its limits
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    client = redis.Redis.from_url(rt.settings.broker_url)
    try:
        [raw] = client.lrange("gpu.audio", 0, -1)
    finally:
        client.close()
    message = json.loads(raw)
    assert message["headers"]["timelimit"] == [None, None], message["headers"]
    assert json.loads(base64.b64decode(message["body"]))[1]["book_id"] == "b"
