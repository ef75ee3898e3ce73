"""Issue 18 on the real stores: a queued job keeps its lease until it starts, the start checks it, the tick
takes over a lapsed lease and blocks a stage whose heartbeats stopped, and the broker's consumer count never
stands in for missing heartbeats."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from animastor_tasks.adapters.redis.presence import PresenceStore
from animastor_tasks.domain.vocabulary import AssetState
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import gate, lanes, refill, takeover
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.flow.job import Job, Watcher
from animastor_tasks.worker.wiring import Wiring
from tests.support import missing

from .helpers import CountingBroker, advertise, lose_leases, make_book, states
from .test_elastic_share import run_control
from .test_generate import dispatched_jobs, with_stage

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


def one_job(rt: Wiring, tmp_path: Path, *, lease_ttl: int = 1, heartbeat_ttl: float = 60.0) -> Job:
    """One audio pair dispatched with a short lease and a job of about a second."""
    spec = replace(rt.settings.registry.get("audio"), lease_ttl=lease_ttl, params={"steps": 6, "step_seconds": 0.2})
    with_stage(rt, spec, tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio", ttl=heartbeat_ttl)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], scenes=[["ch1", "s1"]])
    (job,) = dispatched_jobs(rt, "b")
    return job


def tick(rt: Wiring) -> list[str]:
    """One beat tick now (the tick's singleton lock of the previous one released): the books it passed."""
    rt.redis.client.delete(rt.redis.keys.lock("tick"))
    return gate.tick(rt.ports)


def events(rt: Wiring, kind: str) -> list[str]:
    with rt.db.read() as conn:
        rows = conn.execute("SELECT dispatch_id FROM events WHERE kind = %s ORDER BY id", (kind,)).fetchall()
    return [r[0] for r in rows]


def test_a_job_queued_longer_than_its_lease_ttl_runs_to_ready(rt: Wiring, tmp_path: Path) -> None:
    """Old code: the lease lapsed in the queue, the job started (token only) and stopped with `lease lost`."""
    job = one_job(rt, tmp_path, lease_ttl=1)
    time.sleep(1.5)  # waits in its queue longer than its lease TTL, with ticks going on
    tick(rt)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"
    result = run_job(rt.ports, job, worker="w")
    assert result["outcome"] == "ready", result
    assert events(rt, "lease.expired") == []
    assert events(rt, "job.started") == [job.dispatch_id]


def test_a_started_job_holds_the_lease_ttl_not_the_queued_lease(rt: Wiring, tmp_path: Path) -> None:
    job = one_job(rt, tmp_path, lease_ttl=2)
    assert rt.redis.client.pttl(rt.redis.keys.lease(*job.lease_pair)) > 3_600_000  # a queued lease
    seen: list[int] = []

    def progress(_: float) -> None:
        seen.append(int(rt.redis.client.pttl(rt.redis.keys.lease(*job.lease_pair))))

    assert run_job(rt.ports, job, worker="w", progress=progress)["outcome"] == "ready"
    assert seen and max(seen) <= 2000  # a dead worker's pair is taken over within one lease TTL


def test_a_job_whose_queued_lease_is_gone_never_starts(rt: Wiring, tmp_path: Path) -> None:
    """Old code: the start looked only at the Postgres token, so the job started and ran until its first
    renewal (`stopping: lease lost`)."""
    job = one_job(rt, tmp_path)
    lose_leases(rt, [job.lease_pair])  # the pair was taken over while the job waited
    result = run_job(rt.ports, job, worker="w")
    assert result["outcome"] == "fence_rejected" and result["reason"] == "lease lost before start"
    assert events(rt, "job.started") == []
    # The delivery took no running marker for the dead dispatch, and ended its undelivered one (it left its queue).
    assert rt.redis.client.exists(rt.redis.keys.running(job.dispatch_id)) == 0
    assert rt.ports.leases.undelivered([job.dispatch_id]) == [None]


def test_the_tick_takes_over_a_started_job_whose_lease_lapsed(rt: Wiring, tmp_path: Path) -> None:
    """Old code: only reconcile (every 30 s) noticed; the tick left the pair `generating`."""
    job = one_job(rt, tmp_path, lease_ttl=1)
    held, owned, *_ = rt.ports.leases.start_delivery(job.lease_pair, job.dispatch_id, "w", 1)  # a worker took it
    assert held and owned and rt.ports.leases.renew_lease(job.lease_pair, job.dispatch_id, 0.3)  # ... cut off
    tick(rt)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"  # its lease is still live
    time.sleep(0.4)
    assert "b" in tick(rt)  # the same tick sends the book's gate pass: the pair is dispatched again at once
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"
    assert len(events(rt, "lease.expired")) == 1


def _lapsed_started_job(rt: Wiring, tmp_path: Path) -> tuple[Job, Watcher]:
    """A started job whose lease vanished (cut off from Redis longer than its TTL), with its watcher."""
    job = one_job(rt, tmp_path, lease_ttl=1)
    held, owned, *_ = rt.ports.leases.start_delivery(job.lease_pair, job.dispatch_id, "w", 1)
    assert held and owned
    lose_leases(rt, [job.lease_pair])
    return job, Watcher(rt.ports, job, rt.settings.registry.get("audio"), "w")


def _one_owner(rt: Wiring, job: Job) -> bool:
    """The job holds the pair's lease exactly when Postgres says the pair is its own."""
    held = rt.ports.leases.lease_holders([job.lease_pair]) == [job.dispatch_id]
    return held == rt.ports.jobs.token_is_current(*job.owned)


def take_over(rt: Wiring) -> None:
    takeover.expire_lapsed(rt.ports, rt.ports.assets.generating_pairs(), {"expired": 0})


def test_a_job_taking_its_lease_back_as_the_tick_takes_its_pair_over_is_one_or_the_other_the_check_first(
    rt: Wiring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher read that the pair was still its job's, the tick took the pair over, then the watcher took
    the lease back: a job ran on with a lease for a pair Postgres had handed on (its lane over-full, its work
    thrown away at its commit)."""
    job, watcher = _lapsed_started_job(rt, tmp_path)
    check = rt.ports.jobs.token_is_current

    def check_then_take_over(*owned: Any, **how: Any) -> bool:
        current = check(*owned, **how)
        take_over(rt)
        return current

    monkeypatch.setattr(rt.ports.jobs, "token_is_current", check_then_take_over)
    taken_back = watcher._take_back()
    monkeypatch.undo()
    assert _one_owner(rt, job)
    assert taken_back == (states(rt, "b")[job.pair] == "generating")


def test_a_job_taking_its_lease_back_as_the_tick_takes_its_pair_over_is_one_or_the_other_the_tick_first(
    rt: Wiring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tick read no lease, the watcher took it back, then the tick took the pair over: the same."""
    job, watcher = _lapsed_started_job(rt, tmp_path)
    undelivered = rt.ports.leases.undelivered
    taken_back: list[bool] = []

    def watcher_then_read(dispatch_ids: Any) -> Any:
        taken_back.append(watcher._take_back())
        return undelivered(dispatch_ids)

    monkeypatch.setattr(rt.ports.leases, "undelivered", watcher_then_read)
    take_over(rt)
    monkeypatch.undo()
    assert taken_back == [True] and _one_owner(rt, job)
    assert states(rt, "b")[job.pair] == "generating"  # the job that came back keeps its pair and its work


def test_a_takeover_that_cannot_read_the_cancel_flag_leaves_the_pair_for_the_next_tick(
    rt: Wiring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fail-closed: facts that could not be read were taken as "not authorized" and the dead job's pair went to
    `dirty`, cut off from its still active command, which then never settled (a Redis that flaps as it recovers
    is when leases lapse)."""
    job = one_job(rt, tmp_path, lease_ttl=1)
    held, owned, *_ = rt.ports.leases.start_delivery(job.lease_pair, job.dispatch_id, "w", 1)
    assert held and owned and rt.ports.leases.renew_lease(job.lease_pair, job.dispatch_id, 0.1)  # then it died
    time.sleep(0.2)

    def unreadable(book: str) -> bool:
        raise StoreUnavailable("redis", rt.settings.redis_url, "connection reset")

    with monkeypatch.context() as patched:
        patched.setattr(rt.ports.book_state, "cancel_flag_set", unreadable)
        tick(rt)
        assert states(rt, "b")[job.pair] == "generating"
    tick(rt)  # readable again: taken over as authorized
    assert states(rt, "b")[job.pair] in ("pending", "generating")
    [command] = rt.ports.commands.commands(book="b")
    assert command.status == "active" and not command.released, command


def test_the_tick_leaves_a_never_started_job_to_reconcile(rt: Wiring, tmp_path: Path) -> None:
    """A lease-less job that was never delivered may still wait in its queue: only the broker can tell."""
    job = one_job(rt, tmp_path)
    lose_leases(rt, [job.lease_pair])
    tick(rt)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"


def test_reconcile_drops_the_queued_lease_of_a_lost_message(
    rt: Wiring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queued lease must not outlive a message the broker lost (a purged queue)."""
    monkeypatch.setattr(reconcile_flow, "RECOUNT_PAUSE_SECONDS", 0.0)
    job = one_job(rt, tmp_path)
    ports = replace(rt.ports, queue_probe=CountingBroker({"gpu.audio": 0}))
    assert reconcile_flow.reconcile(ports, force=True)["expired"] == 1
    assert states(rt, "b")[("ch1", "s1", "audio")] in ("pending", "generating")
    assert rt.ports.leases.lease_holders([job.lease_pair]) != [job.dispatch_id]
    # The message turns up after all (a worker that was cut off hands it back): it does not start.
    assert run_job(rt.ports, job, worker="w")["outcome"] == "fence_rejected"


def test_the_tick_blocks_a_stage_whose_heartbeats_stopped(rt: Wiring, tmp_path: Path) -> None:
    """Old code: only reconcile (30 s) blocked a stage with jobs in flight and no live worker."""
    one_job(rt, tmp_path, lease_ttl=60, heartbeat_ttl=0.5)
    tick(rt)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"
    time.sleep(0.6)
    tick(rt)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "dirty"
    (command,) = rt.ports.commands.commands(book="b")
    assert (command.status, command.reason) == ("blocked", "no_worker:audio")


def test_a_stage_whose_only_worker_stopped_cleanly_waits_for_its_successor(rt: Wiring, tmp_path: Path) -> None:
    """A deployment replacing a stage's only worker (`docker compose up`): the old one stops cleanly and withdraws,
    the new one consumes seconds later. Old code: the tick in between BLOCKED the command with its job in flight,
    and a regenerate sent then was BLOCKED too, both for good."""
    one_job(rt, tmp_path, lease_ttl=60)
    rt.presence.heartbeat("test-worker@local", (), 0, gone=["gpu.audio"])  # its warm shutdown
    tick(rt)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"
    rt.catalog.import_book(make_book("c", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "c", ["audio"])
    assert states(rt, "c")[("ch1", "s1", "audio")] == "pending"
    assert {c.status for c in rt.ports.commands.commands(book="b") + rt.ports.commands.commands(book="c")} == {"active"}
    advertise(rt, "gpu.audio", host="successor@local")
    tick(rt)
    gate.gate_pass(rt.ports, "c")
    assert states(rt, "c")[("ch1", "s1", "audio")] == "generating"


def test_a_stage_whose_last_worker_stopped_cleanly_is_blocked_once_none_came_in_time(
    rt: Wiring, tmp_path: Path
) -> None:
    one_job(rt, tmp_path, lease_ttl=60)
    rt.presence.heartbeat("test-worker@local", (), 0, gone=["gpu.audio"])
    left = rt.redis.server_time() - rt.settings.silent_worker_seconds - 1  # as if that long ago
    rt.redis.client.zadd(rt.redis.keys.departures(), {"gpu.audio": left})
    tick(rt)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "dirty"
    (command,) = rt.ports.commands.commands(book="b")
    assert (command.status, command.reason) == ("blocked", "no_worker:audio")


def test_a_stage_whose_worker_stopped_waits_for_its_successor_while_another_worker_drains(
    rt: Wiring, tmp_path: Path
) -> None:
    """`docker compose up` on a GPU host stops its old containers, then starts the new ones once all have stopped:
    an idle audio worker stopped at once while the image worker drained a long job, and 30 s later the tick BLOCKED
    the audio commands with work in flight, for good, their successor still waiting for the drain."""
    one_job(rt, tmp_path, lease_ttl=60)
    rt.presence.heartbeat("test-worker@local", (), 0, gone=["gpu.audio"])
    left = rt.redis.server_time() - rt.settings.silent_worker_seconds - 1  # its grace is over
    rt.redis.client.zadd(rt.redis.keys.departures(), {"gpu.audio": left})
    rt.presence.heartbeat("image@draining", ["gpu.image"], 60, holding=True)  # a warm shutdown, its job running
    tick(rt)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"
    (command,) = rt.ports.commands.commands(book="b")
    assert command.status == "active"
    rt.presence.heartbeat("image@draining", (), 0, gone=["gpu.image"])  # drained: compose starts the successors now
    tick(rt)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"
    old = rt.redis.server_time() - rt.settings.silent_worker_seconds - 1  # none came within the grace of that stop
    rt.redis.client.zadd(rt.redis.keys.departures(), {"gpu.image": old})
    tick(rt)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "dirty"
    (command,) = rt.ports.commands.commands(book="b")
    assert (command.status, command.reason) == ("blocked", "no_worker:audio")


def test_a_clean_stop_beside_a_live_worker_does_not_delay_blocking_once_that_one_dies(
    rt: Wiring, tmp_path: Path
) -> None:
    """Worker A stopped cleanly while B still consumed the queue, then B died: the departure A left made the stage
    wait for a successor (30 s) although its last worker had died, not stopped (one presence TTL)."""
    one_job(rt, tmp_path, lease_ttl=60, heartbeat_ttl=60)
    advertise(rt, "gpu.audio", host="b@local", ttl=0.5)
    rt.presence.heartbeat("test-worker@local", (), 0, gone=["gpu.audio"])  # A's warm shutdown, B still live
    time.sleep(0.6)  # B dies: its heartbeat lapses
    tick(rt)
    (command,) = rt.ports.commands.commands(book="b")
    assert (command.status, command.reason) == ("blocked", "no_worker:audio")


def test_the_tick_blocks_no_stage_while_heartbeats_come_back_after_redis_did(
    rt: Wiring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heartbeats lapse while Redis cannot be reached, and come back within a heartbeat of it: a tick run in between
    read "no consumer" and BLOCKED every stage with jobs in flight, its commands ended for good."""
    import redis as redis_py

    one_job(rt, tmp_path, lease_ttl=60, heartbeat_ttl=1)

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise redis_py.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    rt.redis.client.delete(rt.redis.keys.lock("tick"))
    with monkeypatch.context() as outage:
        outage.setattr(rt.redis.client, "execute_command", unreachable)
        with pytest.raises(StoreUnavailable):
            gate.tick(rt.ports)
        time.sleep(1.1)  # the workers' heartbeats lapse meanwhile
    tick(rt)  # Redis answers again; the workers have not beaten yet
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"
    (command,) = rt.ports.commands.commands(book="b")
    assert command.status == "active", command
    time.sleep(rt.settings.presence_ttl_seconds)  # and when they never come back, the stage is BLOCKED after all
    tick(rt)
    (command,) = rt.ports.commands.commands(book="b")
    assert (command.status, command.reason) == ("blocked", "no_worker:audio")


def _while_the_worker_beats_again(rt: Wiring, run: Callable[[], object]) -> None:
    """`run`, while the audio worker beats again half a second in (Redis answering again)."""
    comes_back = threading.Timer(0.5, advertise, (rt, "gpu.audio"))
    comes_back.start()
    try:
        run()
    finally:
        comes_back.join()


def test_a_process_that_saw_nothing_of_an_outage_blocks_no_stage_whose_heartbeat_comes_back(
    rt: Wiring, tmp_path: Path
) -> None:
    """The workers' heartbeats lapsed while Redis could not be reached, and come back within a heartbeat of it. A
    control process that had sent Redis nothing meanwhile (idle, or its broker down too) knew of no outage: its
    tick read "no consumer" and BLOCKED the stage with its job running, for good. It now looks again a heartbeat
    later, and blocks only a stage still without one."""
    one_job(rt, tmp_path, lease_ttl=60, heartbeat_ttl=0.5)
    time.sleep(0.6)  # lapsed: nobody could beat while Redis was away
    _while_the_worker_beats_again(rt, lambda: tick(rt))
    (command,) = rt.ports.commands.commands(book="b")
    assert command.status == "active", command
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"


def test_a_pass_of_pending_pairs_blocks_no_stage_whose_heartbeat_comes_back(rt: Wiring, tmp_path: Path) -> None:
    """The same, in a gate pass with pairs still to dispatch: it BLOCKED the stage's commands and released them."""
    with_stage(rt, replace(rt.settings.registry.get("audio"), book_cap=1), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio", ttl=0.5)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # s1 runs, s2 waits (the book's cap)
    time.sleep(0.6)
    rt.ports.deferrals.clear_deferrals("b", [("ch1", "s2", "audio")])
    _while_the_worker_beats_again(rt, lambda: gate.gate_pass(rt.ports, "b"))
    (command,) = rt.ports.commands.commands(book="b")
    assert command.status == "active", command


def test_an_outage_without_data_loss_reads_no_forced_pairs_back_from_postgres(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The force set is read back from Postgres after Redis lost its data; after an outage that lost nothing the
    set is still there, and reading it back would cost every pass a query over the book's commands."""
    import redis as redis_py

    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise redis_py.ConnectionError("Connection refused.")

    with monkeypatch.context() as outage:
        outage.setattr(rt.redis.client, "execute_command", unreachable)
        with pytest.raises(StoreUnavailable):
            rt.ports.book_state.cancel_flag_set("b")
    read_back: list[Any] = []
    monkeypatch.setattr(rt.ports.commands, "forced_in_flight", lambda *args: read_back.append(args) or [])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert rt.redis.recovered_at > 0 and "generating" in states(rt, "b").values()
    assert read_back == []


def _amqp_reachable() -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", 5672), timeout=1):
        return True
    return False


def test_a_broker_consumer_never_stands_in_for_missing_heartbeats(rt: Wiring) -> None:
    """Old code: heartbeats gone, the AMQP count (a half-open connection of a cut-off worker) said 1."""
    if not _amqp_reachable():
        missing("RabbitMQ is not listening on 127.0.0.1:5672")
    from kombu import Connection, Queue

    queue = f"gpu.test-{uuid.uuid4().hex[:8]}"
    presence = PresenceStore(rt.redis, AMQP_URL)
    with Connection(AMQP_URL, connect_timeout=3) as conn:
        channel = conn.channel()
        q = Queue(queue, auto_delete=True)(channel)
        q.declare()
        q.consume(callback=lambda *_: None)  # the broker counts this consumer
        try:
            assert presence.counts([queue]) == {queue: 0}  # no heartbeat: not live
            presence.heartbeat("w@h", [queue], 30)
            assert presence.counts([queue]) == {queue: 1}
        finally:
            q.delete()
    # A heartbeat without a consumer: the broker's zero wins (a killed worker's connection closed at once)...
    assert presence.counts([queue]) == {queue: 0}
    # ...unless the worker says it holds the queue (draining its job at a warm shutdown, or reconnecting).
    presence.heartbeat("w@h", [queue], 30, holding=True)
    assert presence.counts([queue]) == {queue: 1}
    presence.heartbeat("w@h", [queue], 30)  # consuming again: it holds nothing, and the broker's count is read
    assert presence.counts([queue]) == {queue: 0}


def _b_waits_behind_a(rt: Wiring, tmp_path: Path) -> str:
    """Books a and b on a lane of one slot whose heartbeats lapse in 0.8 s: a's job holds the slot and b
    waits for the lane (capacity deferral). Returns the lane's waiting list key."""
    spec = replace(rt.settings.registry.get("audio"), lane_limit=1, lease_ttl=60)
    with_stage(rt, spec, tmp_path)
    for book in ("a", "b"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    advertise(rt, "gpu.audio", ttl=0.8)
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # lane full: deferred, waits for the lane
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"
    waiters = rt.redis.keys.lane_waiters("gpu.audio")
    assert rt.redis.client.zrange(waiters, 0, -1) == ["b"]
    return waiters


def _b_is_blocked_once_handed_the_lane(rt: Wiring, waiters: str) -> None:
    assert rt.redis.client.zrange(waiters, 0, -1) == []  # handed the lane: its pass is on its way
    refill.refill(rt.ports, "b", "gpu.audio")  # that refill, as the control worker runs it
    (command,) = rt.ports.commands.commands(book="b")
    assert (command.status, command.reason) == ("blocked", "no_worker:audio")


def test_the_tick_hands_a_worker_less_lane_to_the_books_waiting_for_it(rt: Wiring, tmp_path: Path) -> None:
    """A book waiting for the lane holds capacity deferrals, which keep its passes from the consumer check for
    a whole window: blocking the running book must also hand the lane to it, so that it is BLOCKED now."""
    waiters = _b_waits_behind_a(rt, tmp_path)
    time.sleep(0.9)
    tick(rt)
    assert states(rt, "a")[("ch1", "s1", "audio")] == "dirty"
    _b_is_blocked_once_handed_the_lane(rt, waiters)


def test_a_pass_that_blocks_a_worker_less_lane_hands_it_to_the_books_waiting_for_it(rt: Wiring, tmp_path: Path) -> None:
    """The running book's lease expired before the tick's consumer check saw its job (reconcile took the pair
    back to `pending`), so its own gate pass is what BLOCKs it. Old code: that pass handed the lane to nobody
    and the waiting book stayed deferred, unblocked, until its capacity window ran out (seen in CI, cluster
    test `test_every_host_of_a_stage_partitioned[redis]`)."""
    waiters = _b_waits_behind_a(rt, tmp_path)
    (job,) = dispatched_jobs(rt, "a")
    time.sleep(0.9)  # every heartbeat of the lane lapsed
    assert rt.ports.assets.expire_generating("a", job.pair, job.fencing_token, AssetState.PENDING, lambda: True)
    gate.gate_pass(rt.ports, "a")
    (command,) = rt.ports.commands.commands(book="a")
    assert (command.status, command.reason) == ("blocked", "no_worker:audio")
    _b_is_blocked_once_handed_the_lane(rt, waiters)


def test_the_slot_of_a_job_taken_over_goes_to_the_book_waiting_for_the_lane(rt: Wiring, tmp_path: Path) -> None:
    """A started job's worker died; the tick took its pair over, but nobody was handed the freed slot: the book
    waiting for the lane waited for its capacity deferral (a minute) beside an idle GPU."""
    spec = replace(rt.settings.registry.get("audio"), lane_limit=1, lease_ttl=1)
    with_stage(rt, spec, tmp_path)
    for book in ("a", "b"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # lane full: waits for the lane
    (job,) = dispatched_jobs(rt, "a")
    held, owned, *_ = rt.ports.leases.start_delivery(job.lease_pair, job.dispatch_id, "w", 1)  # a worker took it
    assert held and owned and rt.ports.leases.renew_lease(job.lease_pair, job.dispatch_id, 0.2)  # ... and died
    time.sleep(0.4)
    assert "a" in tick(rt)  # taken over: a's pair is pending again, and a is due
    assert states(rt, "a")[("ch1", "s1", "audio")] == "pending"
    # b handed the slot; a, its pair pending again, waits behind it (as at a job's end: same priority, b waited longer)
    assert rt.redis.client.zrange(rt.redis.keys.lane_waiters("gpu.audio"), 0, -1) == ["a"]
    refill.refill(rt.ports, "b", "gpu.audio")  # that refill, as the control worker runs it
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"


def test_a_passive_declare_that_fails_for_another_reason_than_a_missing_queue_is_no_count(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every failed passive declare was read as a queue nobody consumes: a broker shutting down (or a queue whose
    node is down) counted 0 consumers, and the tick BLOCKED a stage whose workers were alive."""
    if not _amqp_reachable():
        missing("RabbitMQ is not listening on 127.0.0.1:5672")
    from amqp import exceptions
    from amqp.channel import Channel

    from animastor_tasks.adapters.broker_probe import amqp_consumer_counts

    url = "amqp://guest:guest@127.0.0.1:5672//"
    absent = f"gpu.none-{uuid.uuid4().hex[:8]}"
    assert amqp_consumer_counts(url, [absent]) == {absent: 0}  # no such queue: nobody consumes it

    def shutting_down(self: Channel, *args: Any, **kwargs: Any) -> Any:
        raise exceptions.ConnectionForced("CONNECTION_FORCED - broker forced connection closure")

    monkeypatch.setattr(Channel, "queue_declare", shutting_down)
    with pytest.raises(StoreUnavailable, match="CONNECTION_FORCED"):
        amqp_consumer_counts(url, ["gpu.audio"])


def _unreachable_amqp_url() -> str:
    """An AMQP URL nothing listens on: a port just bound and closed again."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"amqp://guest:guest@127.0.0.1:{port}//"


def test_a_broker_that_cannot_count_consumers_blocks_nothing_and_reconcile_goes_on(rt: Wiring) -> None:
    """Old code: the passive declare's connection error escaped `block_consumerless`, and the whole reconcile
    pass failed with it (nothing after it ran: the gate batch, the freed slots handed on)."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    audio = {pair: state for pair, state in states(rt, "b").items() if pair[2] == "audio"}
    assert set(audio.values()) == {"generating"}
    rt.ports = replace(rt.ports, presence=PresenceStore(rt.redis, _unreachable_amqp_url()))
    report = reconcile_flow.reconcile(rt.ports, force=True)
    assert report["blocked"] == 0
    [command] = rt.ports.commands.commands(book="b")
    assert command.status == "active"
    assert {pair: states(rt, "b")[pair] for pair in audio} == audio


def test_the_queues_view_shows_an_unreadable_broker_count_as_unknown(rt: Wiring) -> None:
    from animastor_tasks.operator.queue_view import queue_overview

    advertise(rt, "gpu.audio")
    rt.presence = PresenceStore(rt.redis, _unreachable_amqp_url())
    rows = {row["queue"]: row for row in queue_overview(rt, running={})}
    assert rows["gpu.audio"]["broker_consumers"] is None
    assert [c["hostname"] for c in rows["gpu.audio"]["consumers"]]  # the heartbeats are still shown


def test_a_slot_handed_while_the_stage_awaits_its_restarted_worker_stays_with_the_waiting_books(
    rt: Wiring, tmp_path: Path
) -> None:
    """Old code: the handed book found the stage's worker restarting, passed the slot on and was off the list; so
    did the next, until the list was empty. Once the new worker consumed, the free slots had nobody to go to and
    the books waited out their capacity deferrals (60 s)."""
    with_stage(rt, replace(rt.settings.registry.get("audio"), lane_limit=1), tmp_path)
    for book in ("w", "x"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    rt.ports.deferrals.wait_for_lane("gpu.audio", "x", 2e10)
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])  # the only slot: its job is in flight
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])  # the lane full: x waits for it
    rt.presence.heartbeat("test-worker@local", (), 0, gone=["gpu.audio"])  # a deploy stops the worker cleanly
    lane = rt.redis.keys.lane_waiters("gpu.audio")
    assert rt.redis.client.zscore(lane, "x") is not None
    with rt.db.transaction() as conn:  # its job ended (its worker let it go) and the slot is x's
        conn.execute("UPDATE asset_states SET state = 'pending', dispatch_id = NULL WHERE book_id = 'w'")
    assert rt.ports.deferrals.next_waiters("gpu.audio", 1) == ["x"]
    refill.refill(rt.ports, "x", "gpu.audio")
    assert rt.redis.client.zscore(lane, "x") is not None  # it waits on, at the head
    assert states(rt, "x")[("ch1", "s1", "audio")] == "pending"
    lanes.consumers_arrived(rt.ports, rt.presence.heartbeat("successor@local", ["gpu.audio"], 60.0))
    run_control(rt)
    assert states(rt, "x")[("ch1", "s1", "audio")] == "generating"


def test_a_book_waiting_for_a_restarted_worker_is_passed_at_its_first_heartbeat_not_at_every_tick(
    rt: Wiring, tmp_path: Path
) -> None:
    """Its pairs waited for no deferral, so the book was due at once: every tick passed it again, all its pairs
    read, for as long as the worker was awaited (30 s; a rollout's drain, a job's time limit more): 100 books of
    1000 pairs cost 1.3-1.9 s a tick. It waits on the lane's list for the worker's first heartbeat instead."""
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("c", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    rt.presence.heartbeat("test-worker@local", (), 0, gone=["gpu.audio"])  # a deploy stops the worker cleanly
    regenerate_flow.regenerate(rt.ports, "c", ["audio"])
    assert set(states(rt, "c").values()) >= {"pending"} and "generating" not in states(rt, "c").values()
    due = rt.redis.client.zscore(rt.redis.keys.due(), "c")
    assert due is not None and due > rt.ports.clock() + rt.settings.silent_worker_seconds - 5
    assert "c" not in tick(rt)
    arrived = rt.presence.heartbeat("successor@local", ["gpu.audio"], 60.0)
    assert arrived == {"gpu.audio"} and rt.presence.heartbeat("successor@local", ["gpu.audio"], 60.0) == set()
    lanes.consumers_arrived(rt.ports, arrived)
    run_control(rt)
    assert [s for (_, _, stage), s in states(rt, "c").items() if stage == "audio"] == ["generating"] * 2


def test_a_lease_unreadable_for_one_pair_leaves_it_to_the_next_tick_and_takes_the_others_over(
    rt: Wiring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The expiry reads the lease again under the row's lock: a Redis error there went past the loop, and the pairs
    already taken over that tick never had their slots handed on."""
    with_stage(rt, replace(rt.settings.registry.get("audio"), lease_ttl=1), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    dead = [g for g in rt.ports.assets.generating_pairs() if g.book == "b"]
    assert len(dead) == 2
    lose_leases(rt, [(g.book, *g.pair) for g in dead])
    holders = rt.ports.leases.lease_holders
    calls: list[int] = []

    def first_unreadable(pairs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise StoreUnavailable("redis", rt.settings.redis_url, "connection reset")
        return holders(pairs)

    monkeypatch.setattr(rt.ports.leases, "lease_holders", first_unreadable)
    report = {"expired": 0}
    takeover.expire(rt.ports, dead, report)
    assert report["expired"] == 1
    assert sorted(v for (_, _, stage), v in states(rt, "b").items() if stage == "audio") == ["generating", "pending"]


def test_a_forced_regenerate_racing_a_takeover_still_clears_the_pairs_input_hash(rt: Wiring, tmp_path: Path) -> None:
    """The takeover moved the pair to `pending` while the forced regenerate's statements ran: the one clearing the
    pending pairs' hash had read it `generating`, the one fencing generating pairs found it `pending` once the
    takeover committed. Its old hash kept, the pair could be settled `already_completed` from the media made
    before the reader asked for fresh media, once the force window was over."""
    import psycopg

    job = one_job(rt, tmp_path)
    with rt.db.transaction() as conn:
        conn.execute("UPDATE asset_states SET input_hash = 'made-before' WHERE book_id = 'b' AND stage = 'audio'")
    regenerating = threading.Thread(
        target=regenerate_flow.regenerate, args=(rt.ports, "b", ["audio"]), kwargs={"scenes": [["ch1", "s1"]]}
    )

    def meanwhile_a_forced_regenerate() -> bool:
        regenerating.start()
        with psycopg.connect(rt.settings.database_url, autocommit=True) as watch:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                waiting = watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database()"
                ).fetchone()[0]
                if waiting:
                    break
                time.sleep(0.01)
        return True

    assert rt.ports.assets.expire_generating("b", job.pair, job.fencing_token, AssetState.PENDING,
                                             meanwhile_a_forced_regenerate)  # fmt: skip
    regenerating.join(30)
    with rt.db.read() as conn:
        [(hashed,)] = conn.execute(
            "SELECT input_hash FROM asset_states WHERE book_id = 'b' AND stage = 'audio'"
        ).fetchall()
    assert hashed is None


def test_a_takeover_that_read_the_layer_off_sends_the_pair_back_to_pending_once_it_is_on_again(
    rt: Wiring, tmp_path: Path
) -> None:
    """The takeover chose `dirty` on facts read before the reader turned the layer on again: released with no reason
    to mark on its command's target, the pair waited for nothing to queue it, and its command stayed active."""
    from animastor_tasks.flow import layers as layers_flow

    job = one_job(rt, tmp_path)
    layers_flow.set_layers(rt.ports, "b", [], ["audio"])  # the takeover reads it off...
    layers_flow.set_layers(rt.ports, "b", ["audio"], [])  # ...and it is on again when the takeover writes
    went = rt.ports.assets.expire_generating("b", job.pair, job.fencing_token, AssetState.DIRTY, lambda: True)
    assert went == AssetState.PENDING and states(rt, "b")[job.pair] == "pending"
    (command,) = rt.ports.commands.commands(book="b")
    assert command.status == "active"
    assert len(gate.gate_pass(rt.ports, "b").dispatched) == 1  # its work goes on


def test_a_takeover_behind_a_cancel_flag_alone_still_releases_the_pair(rt: Wiring, tmp_path: Path) -> None:
    """A Stop All whose Postgres half failed leaves the Redis flag alone: judged again under the lock on Postgres's
    facts only, the release to `dirty` turned `pending`, a pair waiting under a cancel (found by the stateful test:
    regenerate, flag only, every lease lost)."""
    job, _ = _lapsed_started_job(rt, tmp_path)
    rt.ports.book_state.stop_book("b")
    take_over(rt)
    assert states(rt, "b")[job.pair] == "dirty"


def test_a_successor_beating_as_a_pass_starts_to_await_it_still_finds_the_book_on_the_list(
    rt: Wiring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass noted the queue awaited before the book joined the lane's list: a successor's first beat in between
    took the note away and handed the lane to a list without the book, whose pairs then waited 30 s."""
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("c", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    rt.presence.heartbeat("test-worker@local", (), 0, gone=["gpu.audio"])  # a deploy stops the worker cleanly
    noted = type(rt.presence).await_consumer

    def noted_then_a_beat(store: PresenceStore, queues: list[str]) -> None:
        noted(store, queues)
        lanes.consumers_arrived(rt.ports, rt.presence.heartbeat("successor@local", ["gpu.audio"], 60.0))

    monkeypatch.setattr(type(rt.presence), "await_consumer", noted_then_a_beat)
    regenerate_flow.regenerate(rt.ports, "c", ["audio"])
    monkeypatch.undo()
    run_control(rt)
    assert "generating" in states(rt, "c").values()


def test_a_book_awaited_then_blocked_leaves_the_lane_s_list(rt: Wiring, tmp_path: Path) -> None:
    """Awaited, the book joined the lane's list; BLOCKED once no successor came in time, it stayed there with
    nothing to run, at its priority: the next hand-over of the lane went to it, and on through the control queue."""
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("c", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    rt.presence.heartbeat("test-worker@local", (), 0, gone=["gpu.audio"])  # a deploy stops the worker cleanly
    regenerate_flow.regenerate(rt.ports, "c", ["audio"], priority="interactive")
    lane = rt.redis.keys.lane_waiters("gpu.audio")
    assert rt.redis.client.zscore(lane, "c") is not None
    rt.redis.client.zadd(rt.redis.keys.departures(), {"gpu.audio": rt.ports.clock() - 100})  # none came in time
    gate.gate_pass(rt.ports, "c")
    assert [c.status for c in rt.ports.commands.commands(book="c")] == ["blocked"]
    assert rt.redis.client.zscore(lane, "c") is None


@pytest.mark.parametrize(
    ("redis_ahead", "started_ago", "restarted_ago", "awaited"),
    [
        # Postgres 30 s ahead of Redis: a job started 5 s ago, before the restart 2 s ago, may take its lease back.
        pytest.param(-30.0, 5.0, 2.0, True, id="postgres-ahead-job-started-before-the-restart"),
        # Redis 30 s ahead: a job started 1 s ago, after the restart 10 s ago, that lost its lease is dead.
        pytest.param(30.0, 1.0, 10.0, False, id="redis-ahead-job-started-after-the-restart"),
    ],
)
def test_a_job_s_start_and_the_redis_restart_are_compared_on_one_clock(
    rt: Wiring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_ahead: float, started_ago: float,
    restarted_ago: float, awaited: bool,
) -> None:  # fmt: skip
    """Old code compared the start's time by Postgres's clock with the restart's by Redis's: the first job was taken
    over at once (its GPU work done again), the second awaited for a lease TTL (its slot idle)."""
    job = one_job(rt, tmp_path, lease_ttl=60)
    with rt.db.transaction() as conn:
        conn.execute(
            "INSERT INTO job_starts (book_id, chapter_id, scene_id, stage, open_dispatch, updated_at)"
            " VALUES (%s, %s, %s, %s, %s, now() - make_interval(secs => %s))",
            (*job.lease_pair, job.dispatch_id, started_ago),
        )
    real = rt.ports.clock
    ports = replace(rt.ports, clock=lambda: real() + redis_ahead)
    monkeypatch.setattr(rt.ports.book_state, "server_started_at", lambda: real() + redis_ahead - restarted_ago)
    monkeypatch.setattr(rt.ports.book_state, "presence_unsure_since", lambda *_: float("-inf"))
    [row] = ports.assets.generating_pairs()

    left = takeover.without_retakes(ports, [row])

    assert row.started and (left == []) is awaited, left
