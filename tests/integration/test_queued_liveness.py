"""Reconcile on a broker that only counts its messages (AMQP): a job waiting in its queue longer than its
lease TTL is alive and keeps a lease; a job the count no longer covers is taken for lost."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from animastor_tasks.domain import liveness
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import CountingBroker, advertise, lose_leases, make_book, states


def dispatch_scenes(rt: Wiring, book: str, scenes: int) -> dict[str, str]:
    """One regenerate per scene, a moment apart (so they are dispatched in order): scene -> dispatch id."""
    rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    advertise(rt, "gpu.audio")
    for s in range(1, scenes + 1):
        regenerate_flow.regenerate(rt.ports, book, ["audio"], scenes=[["ch1", f"s{s}"]])
        time.sleep(0.01)
    with rt.db.read() as conn:
        rows = conn.execute(
            "SELECT scene_id, dispatch_id FROM asset_states WHERE book_id = %s AND stage = 'audio'"
            " AND state = 'generating'",
            (book,),
        ).fetchall()
    assert len(rows) == scenes
    return dict(rows)


def lapse_leases(rt: Wiring, book: str, scenes: int) -> None:
    """The jobs waited in their queue longer than their lease TTL."""
    lose_leases(rt, [(book, "ch1", f"s{s}", "audio") for s in range(1, scenes + 1)])


def test_a_counted_backlog_is_alive_and_keeps_its_leases(rt: Wiring) -> None:
    ids = dispatch_scenes(rt, "b", 3)
    lapse_leases(rt, "b", 3)
    ports = replace(rt.ports, queue_probe=CountingBroker({"gpu.audio": 3}))
    report = reconcile_flow.reconcile(ports, force=True)
    assert report["expired"] == 0
    assert {state for (_, _, stage), state in states(rt, "b").items() if stage == "audio"} == {"generating"}
    pairs = [("b", "ch1", f"s{s}", "audio") for s in range(1, 4)]
    assert rt.ports.leases.lease_holders(pairs) == [ids[f"s{s}"] for s in range(1, 4)]
    ttl = rt.redis.client.pttl(rt.redis.keys.lease(*pairs[0])) / 1000
    assert ttl > rt.settings.registry.get("audio").lease_ttl  # it outlives the next pass


def test_the_oldest_jobs_the_count_does_not_cover_are_lost(rt: Wiring, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reconcile_flow, "RECOUNT_PAUSE_SECONDS", 0.0)
    ids = dispatch_scenes(rt, "b", 3)
    lapse_leases(rt, "b", 3)
    ports = replace(rt.ports, queue_probe=CountingBroker({"gpu.audio": 1}))  # two messages were lost
    assert reconcile_flow.reconcile(ports, force=True)["expired"] == 2
    audio = {scene: state for (_, scene, stage), state in states(rt, "b").items() if stage == "audio"}
    assert audio == {"s1": "pending", "s2": "pending", "s3": "generating"}  # the newest is the one still queued
    assert rt.ports.leases.lease_holders([("b", "ch1", "s3", "audio")]) == [ids["s3"]]


def test_a_delivered_job_is_not_counted_as_queued(rt: Wiring, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that was delivered and then died lost its lease for good: the count (other jobs' messages)
    does not keep it alive, and the delivery ended its undelivered marker."""
    monkeypatch.setattr(reconcile_flow, "RECOUNT_PAUSE_SECONDS", 0.0)
    ids = dispatch_scenes(rt, "b", 2)
    assert rt.ports.leases.undelivered([ids["s1"], ids["s2"]])[0] is not None
    held, owned, *_ = rt.ports.leases.start_delivery(("b", "ch1", "s1", "audio"), ids["s1"], "w", 5)
    assert held and owned
    assert rt.ports.leases.undelivered([ids["s1"], ids["s2"]])[0] is None
    lapse_leases(rt, "b", 2)
    ports = replace(rt.ports, queue_probe=CountingBroker({"gpu.audio": 5}))
    assert reconcile_flow.reconcile(ports, force=True)["expired"] == 1
    audio = {scene: state for (_, scene, stage), state in states(rt, "b").items() if stage == "audio"}
    assert audio == {"s1": "pending", "s2": "generating"}


def test_restoring_a_lease_never_takes_it_from_another_dispatch(rt: Wiring) -> None:
    pair = ("b", "ch1", "s1", "audio")
    rt.ports.leases.take_leases([(pair, "newer", 30, {})])
    rt.ports.leases.restore_leases([(pair, "older", 1, 90)])
    assert rt.ports.leases.lease_holders([pair]) == ["newer"]
    assert rt.redis.client.pttl(rt.redis.keys.lease(*pair)) <= 30_000
    rt.ports.leases.restore_leases([(pair, "newer", 1, 90)])
    assert rt.redis.client.pttl(rt.redis.keys.lease(*pair)) > 30_000
    lose_leases(rt, [pair])
    rt.ports.leases.restore_leases([(pair, "older", 1, 90)])
    assert rt.ports.leases.lease_holders([pair]) == ["older"]


def test_restoring_a_queued_lease_leaves_a_job_that_started_meanwhile_alone(rt: Wiring) -> None:
    """Reconcile saw the job in its queue, a worker started it (its lease now the stage's TTL), then reconcile
    restored the queued lease: a day long, so a worker that died early kept the pair generating for a day."""
    ids = dispatch_scenes(rt, "b", 1)
    pair = ("b", "ch1", "s1", "audio")
    held, owned, *_ = rt.ports.leases.start_delivery(pair, ids["s1"], "w", 5)
    assert held and owned
    rt.ports.leases.restore_leases([(pair, ids["s1"], 1, liveness.queued_lease_ttl())])
    assert 0 < rt.redis.client.pttl(rt.redis.keys.lease(*pair)) <= 5_000
    assert rt.ports.leases.lease_holders([pair]) == [ids["s1"]]
