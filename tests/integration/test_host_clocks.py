"""What one host writes by time and another reads (heartbeats, the circuit breaker) goes by the Redis server's
clock, so a GPU host whose clock is off is neither taken for gone (its stage BLOCKED as `no_worker`) nor kept
alive after it died, and its breaker holds for its cool-down. Each "host" is a connection of its own, as a
separate machine has; a host's clock being off is its `time.time` shifted while it writes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from animastor_tasks.adapters.redis.breaker import BreakerStore
from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.adapters.redis.leases import LeaseStore
from animastor_tasks.adapters.redis.presence import PresenceStore
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow import takeover
from animastor_tasks.worker import wiring
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, states
from .test_commands import cap_books
from .test_generate import dispatched_jobs, with_stage

TTL = 6.0


@contextmanager
def clock_off_by(monkeypatch: pytest.MonkeyPatch, seconds: float) -> Iterator[None]:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)
    try:
        yield
    finally:
        monkeypatch.setattr(time, "time", real)


@pytest.mark.parametrize("off", [-30.0, 30.0])
def test_a_host_whose_clock_is_off_counts_as_live_for_its_ttl_and_no_longer(rt: Wiring, monkeypatch, off) -> None:
    host = RedisConnection(rt.settings.redis_url, rt.redis.keys)
    try:
        with clock_off_by(monkeypatch, off):
            PresenceStore(host).heartbeat("audio@skewed", ["gpu.audio"], TTL)
        assert rt.presence.counts(["gpu.audio"]) == {"gpu.audio": 1}
        [expiry] = rt.presence.live_consumers(["gpu.audio"])["gpu.audio"].values()
        assert abs(expiry - (rt.redis.server_time() + TTL)) < 1.0
        assert rt.ports.book_state.book_snapshots(["b"], time.time(), ["gpu.audio"])["b"].consumers == {"gpu.audio": 1}
        # Gone once its TTL has passed by the server's clock, whatever the host's clock said.
        assert rt.presence.live_consumers(["gpu.audio"], rt.redis.server_time() + TTL + 0.1) == {"gpu.audio": {}}
    finally:
        host.close()


def test_a_breaker_a_host_with_its_clock_behind_opens_holds_for_its_cooldown(rt: Wiring, monkeypatch) -> None:
    """Scored by the GPU host's clock, 60 s behind, a 30 s cool-down was over before it began: the control
    host handed out a test permit at once, to a backend that had just failed."""
    host = RedisConnection(rt.settings.redis_url, rt.redis.keys)
    try:
        with clock_off_by(monkeypatch, -60.0):
            assert BreakerStore(host).breaker_record_run("gpu.audio", False, 1, 30.0, None).state == "open"
        assert rt.breaker.breaker_state("gpu.audio") == "open"
        assert rt.breaker.breaker_acquire("gpu.audio", 5.0) == "open"
    finally:
        host.close()


def test_a_breaker_a_host_with_its_clock_ahead_opens_ends_with_its_cooldown(rt: Wiring, monkeypatch) -> None:
    host = RedisConnection(rt.settings.redis_url, rt.redis.keys)
    try:
        with clock_off_by(monkeypatch, 60.0):
            assert BreakerStore(host).breaker_record_run("gpu.audio", False, 1, 0.5, None).state == "open"
        time.sleep(0.6)
        assert rt.breaker.breaker_state("gpu.audio") == "half-open"
        assert rt.breaker.breaker_acquire("gpu.audio", 5.0) == "permit"
    finally:
        host.close()


def test_a_deferral_written_by_a_control_host_whose_clock_is_ahead_ends_on_time(rt: Wiring, monkeypatch) -> None:
    """A pass on a control host 60 s ahead wrote a capacity deferral (a minute) that ended two minutes away for
    every other host: the pair waited twice its window for a pass that would give it a free slot."""
    cap_books(rt, cap=1)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    with clock_off_by(monkeypatch, 60.0):
        host = wiring.build(rt.settings)
        try:
            regenerate_flow.regenerate(host.ports, "b", ["audio"])
        finally:
            host.close()
    [(member, ends)] = rt.redis.client.zrange(rt.redis.keys.deferrals("b", "capacity"), 0, -1, withscores=True)
    assert member == "ch1:s2:audio"
    window = rt.settings.deferral_windows.capacity_seconds
    assert abs(ends - (rt.redis.server_time() + window)) < 5.0, ends - rt.redis.server_time()


def test_a_process_that_started_with_redis_down_dates_its_recovery_by_the_servers_clock(
    rt: Wiring, monkeypatch
) -> None:
    """Its clock offset was never measured; dated by its own clock 60 s behind, the recovery looked a minute old
    at once, and "no consumer" was believed before the workers could beat again: stages BLOCKED."""
    host = RedisConnection("redis://127.0.0.1:1/0", rt.redis.keys, socket_timeout=0.2)  # nothing listens there
    try:
        with clock_off_by(monkeypatch, -60.0):
            with pytest.raises(StoreUnavailable):
                host.ping()
            host.client = rt.redis.client  # Redis answers again
            host.ping()
            recovered = host.recovered_at
        assert abs(recovered - rt.redis.server_time()) < 2.0, recovered - rt.redis.server_time()
    finally:
        host.client = None  # type: ignore[assignment]  # the borrowed client stays the fixture's


def redis_now(rt: Wiring) -> float:
    seconds, micros = rt.redis.client.time()
    return seconds + micros / 1e6


def test_a_host_resumed_from_a_suspend_beats_by_the_server_s_clock_at_once(rt: Wiring, monkeypatch) -> None:
    """A host suspended 40 s: its monotonic clock, which carried its offset to the server's clock, did not count
    the suspend, and it measured that offset again only a minute later by that clock. Meanwhile its heartbeats were
    dated 40 s in the past: its stage read as gone (BLOCKED) and its running jobs were let go. Its wall clock did
    count the suspend: the gap between the two clocks moving is what sends it to measure again."""
    host = RedisConnection(rt.settings.redis_url, rt.redis.keys)
    try:
        PresenceStore(host).heartbeat("audio@resumed", ["gpu.audio"], TTL)  # measured before the suspend
        host._server_minus_monotonic -= 40.0  # type: ignore[operator]  # the 40 s its monotonic clock missed
        with clock_off_by(monkeypatch, 40.0):  # which its wall clock counted
            PresenceStore(host).heartbeat("audio@resumed", ["gpu.audio"], TTL)
            breaker = BreakerStore(host).breaker_record_run("gpu.audio", False, 1, 30.0, None).state
        [expiry] = rt.presence.live_consumers(["gpu.audio"])["gpu.audio"].values()
        assert abs(expiry - (redis_now(rt) + TTL)) < 1.0
        assert breaker == "open" and rt.breaker.breaker_state("gpu.audio") == "open"  # its cool-down holds
    finally:
        host.close()


def test_a_step_of_the_redis_host_s_clock_splits_no_reader_from_the_hosts_it_judges(rt: Wiring) -> None:
    """The Redis host's clock stepped 10 s (NTP): each process saw it only at its next measure, up to a minute
    later. A GPU host that had not measured again dated its beats 10 s off the control process that had: its stage
    was BLOCKED (no_worker) under its live worker. A beat, and each judgement of beats that can block a stage or let
    a node go, measures the offset first."""
    gpu = RedisConnection(rt.settings.redis_url, rt.redis.keys)
    try:
        gpu.server_time()
        gpu._server_minus_monotonic -= 10.0  # type: ignore[operator]  # not measured since the step
        PresenceStore(gpu).heartbeat("audio@stale", ["gpu.audio"], TTL)
        rt.redis.server_time()
        rt.redis._server_minus_monotonic += 10.0  # type: ignore[operator]  # the reader's stale the other way
        assert rt.presence.counts(["gpu.audio"]) == {"gpu.audio": 1}
        assert list(rt.presence.last_beats(["audio@stale"]).values()) == [pytest.approx(redis_now(rt), abs=1.0)]
    finally:
        gpu.close()


def test_a_control_process_that_had_not_measured_since_a_step_lets_no_live_worker_go(rt: Wiring, tmp_path) -> None:
    """The tick's judgement of silent workers dated "now" before reading the beats: a control process 40 s ahead
    of the server's clock (a step it had not measured yet) took a worker beating every two seconds for silent and
    threw its running job away."""
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    gpu = RedisConnection(rt.settings.redis_url, rt.redis.keys)
    try:
        PresenceStore(gpu).heartbeat("audio@gpu-1", ["gpu.audio"], rt.settings.presence_ttl_seconds)
        regenerate_flow.regenerate(rt.ports, "b", ["audio"])
        [job] = dispatched_jobs(rt, "b")
        started = LeaseStore(gpu).start_delivery(job.lease_pair, job.dispatch_id, "audio@gpu-1#77", 120)
        assert started[:2] == (True, True)
        rt.redis.server_time()
        rt.redis._server_minus_monotonic += 40.0  # type: ignore[operator]  # the step not measured yet
        report = takeover.on_tick(rt.ports)
        assert report["let_go"] == 0 and report["blocked"] == 0, report
        assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"
    finally:
        gpu.close()
