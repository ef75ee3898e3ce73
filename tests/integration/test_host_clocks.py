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
from animastor_tasks.adapters.redis.presence import PresenceStore
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker import wiring
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book
from .test_commands import cap_books

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
            assert BreakerStore(host).breaker_record("gpu.audio", False, 1, 30.0, run=True) == "open"
        assert rt.breaker.breaker_state("gpu.audio") == "open"
        assert rt.breaker.breaker_acquire("gpu.audio", 5.0) == "open"
    finally:
        host.close()


def test_a_breaker_a_host_with_its_clock_ahead_opens_ends_with_its_cooldown(rt: Wiring, monkeypatch) -> None:
    host = RedisConnection(rt.settings.redis_url, rt.redis.keys)
    try:
        with clock_off_by(monkeypatch, 60.0):
            assert BreakerStore(host).breaker_record("gpu.audio", False, 1, 0.5, run=True) == "open"
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
