"""A job whose worker node stopped beating (a lost host, a pod replaced under a new name) gives up its lease on the
next tick, which takes its pair over at once; a node still beating, one only just late, or one with no heartbeat on
record keeps its jobs until their leases lapse (real Redis and Postgres, the tick's own flow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow import takeover
from animastor_tasks.flow.job import Job
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, states
from .test_generate import dispatched_jobs, with_stage

NODE = "audio@gpu-lost"
HOLDER = f"{NODE}#4242"


def _running_job(rt: Wiring, tmp_path: Path) -> Job:
    """One audio job started by `HOLDER` with the default 120 s lease, and a live consumer elsewhere."""
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio", host="audio@gpu-alive")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    assert rt.ports.leases.start_delivery(job.lease_pair, job.dispatch_id, HOLDER, 120)[:2] == (True, True)
    return job


def _beat(rt: Wiring, expired_ago: float) -> None:
    """`NODE`'s last heartbeat, which expired `expired_ago` seconds ago (negative: still live)."""
    rt.presence.heartbeat(NODE, ["gpu.audio"], -expired_ago)


def _state(rt: Wiring) -> str:
    return states(rt, "b")[("ch1", "s1", "audio")]


def test_a_job_of_a_node_silent_for_two_presence_ttls_is_taken_over_on_the_tick(rt: Wiring, tmp_path: Path) -> None:
    """Old code: the pair stayed `generating` under its 120 s lease."""
    job = _running_job(rt, tmp_path)
    _beat(rt, rt.settings.presence_ttl_seconds + 1)

    report = takeover.on_tick(rt.ports)

    assert _state(rt) == "pending"
    assert report["let_go"] == 1 and report["expired"] == 1, report
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [None]
    assert rt.ports.leases.delivery_holders([job.dispatch_id]) == [None]
    rt.counters.flush()
    assert rt.redis.client.hget(rt.redis.keys.metrics(), "job:node_lost:audio") == "1"


@pytest.mark.parametrize(
    "expired_ago",
    [
        pytest.param(-5.0, id="still-beating"),
        pytest.param(1.0, id="late-by-less-than-a-ttl"),
        pytest.param(None, id="no-heartbeat-on-record"),
    ],
)
def test_a_job_of_a_node_not_known_to_be_gone_keeps_its_lease(
    rt: Wiring, tmp_path: Path, expired_ago: float | None
) -> None:
    job = _running_job(rt, tmp_path)
    if expired_ago is not None:
        _beat(rt, expired_ago)

    report = takeover.on_tick(rt.ports)

    assert report["let_go"] == 0 and report["expired"] == 0, report
    assert _state(rt) == "generating"
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [job.dispatch_id]
    assert rt.ports.leases.delivery_holders([job.dispatch_id]) == [HOLDER]


def test_silence_proves_nothing_right_after_redis_lost_its_data(rt: Wiring, tmp_path: Path) -> None:
    """Heartbeats come back within a beat of a flushed Redis; until then every node looks silent."""
    job = _running_job(rt, tmp_path)
    _beat(rt, rt.settings.presence_ttl_seconds + 1)
    rt.ports.book_state.presence_unsure_since()  # the dataset token, as every process has seen it
    rt.redis.client.delete(rt.redis.keys.epoch())  # what a FLUSHALL does to it

    assert takeover.on_tick(rt.ports)["let_go"] == 0
    assert _state(rt) == "generating"
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [job.dispatch_id]


def test_a_name_silent_for_a_day_is_forgotten(rt: Wiring) -> None:
    rt.presence.heartbeat("audio@gone-long-ago", ["gpu.audio"], -2 * 24 * 3600)
    _beat(rt, 30)
    beats = rt.ports.presence.last_beats(["gpu.audio", "gpu.image"])
    assert set(beats) == {NODE}
    assert rt.redis.client.zscore(rt.redis.keys.consumers("gpu.audio"), "audio@gone-long-ago") is None
