"""A job whose worker node has not beaten for `silent_worker_seconds` (a lost host, a pod replaced under a new name)
gives up its lease on the next tick, which takes its pair over at once; a node that beat more recently, or one with
no heartbeat on record, keeps its jobs until their leases lapse (real Redis and Postgres, the tick's own flow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from animastor_tasks.errors import StoreUnavailable
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


def _beat(rt: Wiring, ago: float, node: str = NODE) -> None:
    """`node`'s heartbeat `ago` seconds ago: its last one."""
    rt.presence.heartbeat(node, ["gpu.audio"], rt.settings.presence_ttl_seconds)
    rt.redis.client.zadd(rt.redis.keys.beats(), {node: rt.redis.server_time() - ago})


def _state(rt: Wiring) -> str:
    return states(rt, "b")[("ch1", "s1", "audio")]


def test_a_job_of_a_silent_node_is_taken_over_on_the_tick(rt: Wiring, tmp_path: Path) -> None:
    """Old code: the pair stayed `generating` under its 120 s lease."""
    job = _running_job(rt, tmp_path)
    _beat(rt, rt.settings.silent_worker_seconds + 1)

    report = takeover.on_tick(rt.ports)

    assert _state(rt) == "pending"
    assert report["let_go"] == 1 and report["expired"] == 1, report
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [None]
    assert rt.ports.leases.delivery_holders([job.dispatch_id]) == [None]
    rt.counters.flush()
    assert rt.redis.client.hget(rt.redis.keys.metrics(), "job:node_lost:audio") == "1"


def test_a_job_of_a_silent_node_is_failed_in_the_result_store(rt: Wiring, tmp_path: Path) -> None:
    """What Flower and a caller's AsyncResult see of a job whose host never came back. Old code: PENDING, the
    STARTED its lost run left standing for good."""
    job = _running_job(rt, tmp_path)
    _beat(rt, rt.settings.silent_worker_seconds + 1)

    takeover.on_tick(rt.ports)

    result = rt.ports.publisher.app.AsyncResult(job.dispatch_id)  # type: ignore[attr-defined]
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "WorkerLostError" and NODE in str(result.result)


def test_a_silent_nodes_job_is_failed_even_when_the_takeover_after_its_let_go_fails(
    rt: Wiring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its lease, running mark and holder are gone after the let-go: no later tick finds the job again. Old code: the
    takeover's read failed, and the job stayed STARTED for good (PENDING here)."""
    job = _running_job(rt, tmp_path)
    _beat(rt, rt.settings.silent_worker_seconds + 1)
    reads = iter([rt.ports.assets.generating_pairs()])

    def failing_after_the_first(*args: object, **kwargs: object) -> object:
        for rows in reads:
            return rows
        raise StoreUnavailable("postgres", "postgresql://db", "server closed the connection unexpectedly")

    monkeypatch.setattr(rt.ports.assets, "generating_pairs", failing_after_the_first)
    report = takeover.on_tick(rt.ports)

    assert report["let_go"] == 1 and report["expired"] == 0, report
    result = rt.ports.publisher.app.AsyncResult(job.dispatch_id)  # type: ignore[attr-defined]
    assert result.state == "FAILURE"
    monkeypatch.undo()
    assert takeover.on_tick(rt.ports)["expired"] == 1  # the next tick takes its pair over
    assert _state(rt) == "pending"


@pytest.mark.parametrize(
    "silence",  # the node's silence, as a share of `silent_worker_seconds`
    [
        pytest.param(0.0, id="beating"),
        pytest.param(0.95, id="silent-for-a-little-less-than-the-setting"),
        pytest.param(None, id="no-heartbeat-on-record"),
    ],
)
def test_a_job_of_a_node_not_known_to_be_gone_keeps_its_lease(
    rt: Wiring, tmp_path: Path, silence: float | None
) -> None:
    job = _running_job(rt, tmp_path)
    if silence is not None:
        _beat(rt, silence * rt.settings.silent_worker_seconds)

    report = takeover.on_tick(rt.ports)

    assert report["let_go"] == 0 and report["expired"] == 0, report
    assert _state(rt) == "generating"
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [job.dispatch_id]
    assert rt.ports.leases.delivery_holders([job.dispatch_id]) == [HOLDER]


def test_silence_proves_nothing_right_after_redis_lost_its_data(rt: Wiring, tmp_path: Path) -> None:
    """Heartbeats come back within a beat of a flushed Redis; until then every node looks silent."""
    job = _running_job(rt, tmp_path)
    _beat(rt, rt.settings.silent_worker_seconds + 1)
    rt.ports.book_state.presence_unsure_since()  # the dataset token, as every process has seen it
    rt.redis.client.delete(rt.redis.keys.epoch())  # what a FLUSHALL does to it

    assert takeover.on_tick(rt.ports)["let_go"] == 0
    assert _state(rt) == "generating"
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [job.dispatch_id]


def test_a_node_beating_with_no_queue_left_is_not_silent(rt: Wiring, tmp_path: Path) -> None:
    """An operator drains a worker with `cancel_consumer`: its queue entries go, its heartbeat goes on."""
    job = _running_job(rt, tmp_path)
    _beat(rt, rt.settings.silent_worker_seconds + 1)
    rt.presence.heartbeat(NODE, [], rt.settings.presence_ttl_seconds, gone=["gpu.audio"])  # its beat now

    assert takeover.on_tick(rt.ports)["let_go"] == 0
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [job.dispatch_id]


def test_a_clean_stop_takes_the_last_beat_away_and_a_name_silent_for_a_day_is_forgotten(rt: Wiring) -> None:
    _beat(rt, 30)
    _beat(rt, 2 * 24 * 3600, node="audio@gone-long-ago")
    rt.presence.heartbeat("audio@stopped", ["gpu.audio"], 6)
    rt.presence.heartbeat("audio@stopped", [], 0, gone=["gpu.audio"])

    beats = rt.ports.presence.last_beats([NODE, "audio@gone-long-ago", "audio@stopped", "audio@never"])

    assert set(beats) == {NODE}
    assert 29 < rt.redis.server_time() - beats[NODE] < 32
    rt.presence.heartbeat("audio@other", ["gpu.audio"], 6)  # a heartbeat drops the name silent for a day
    assert set(rt.redis.client.zrange(rt.redis.keys.beats(), 0, -1)) == {NODE, "audio@other"}


def test_the_last_beats_are_read_with_a_read_only_redis_user(rt: Wiring) -> None:
    """The queue view and the metrics exporter read them, and the read pruned on the way: a read-only Redis user
    (or a replica) was refused (NOPERM), the view exited 3, and the exporter reported Redis down."""
    import uuid
    from urllib.parse import urlsplit, urlunsplit

    from animastor_tasks.adapters.redis.connection import RedisConnection
    from animastor_tasks.adapters.redis.presence import PresenceStore

    _beat(rt, 30)
    user = f"reader-{uuid.uuid4().hex[:8]}"
    rt.redis.client.execute_command(
        "ACL", "SETUSER", user, "on", "nopass", "~*", "resetchannels", "-@all", "+@read", "+time", "+select"
    )
    try:
        parts = urlsplit(rt.settings.redis_url)
        url = urlunsplit(parts._replace(netloc=f"{user}@{parts.hostname}:{parts.port or 6379}"))
        reader = RedisConnection(url, rt.redis.keys)
        try:
            beats = PresenceStore(reader).last_beats([NODE, "audio@never"])
        finally:
            reader.client.close()
    finally:
        rt.redis.client.execute_command("ACL", "DELUSER", user)
    assert set(beats) == {NODE}


def test_a_queue_forgets_consumers_silent_for_a_day(rt) -> None:
    """A consumer's entry left only with a clean stop: every pod a rollout replaced (a new name each time) or
    killed stayed in its queue's consumers for ever."""
    key = rt.redis.keys.consumers("gpu.audio")
    now = rt.redis.server_time()
    rt.redis.client.zadd(key, {"audio@pod-gone-2d": now - 2 * 86_400, "audio@pod-gone-1h": now - 3_600})
    rt.presence.heartbeat("audio@pod-live", ["gpu.audio"], 60.0)
    assert set(rt.redis.client.zrange(key, 0, -1)) == {"audio@pod-gone-1h", "audio@pod-live"}
