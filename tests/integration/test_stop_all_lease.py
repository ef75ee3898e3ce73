"""A Stop All whose Redis step failed after its Postgres commit leaves its released job's queued lease (a day) and
the pair's dispatch id: a later `force=false` regenerate defers the pair `already_generating` for no longer than the
stage's lease TTL, not for the idempotent window (900 s): a pair that is not generating is held by no job it could
serve (the job cannot commit it), and the lease goes once the message is refused at its start."""

from __future__ import annotations

import pytest

from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book, states
from .test_elastic_share import lane


def test_a_regenerate_after_a_half_done_stop_all_waits_a_lease_ttl_at_most(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old code: the pair was deferred for 900 s (`ends[0][1] - now > 800`), min(window, the queued lease's day)."""
    lane(rt, lane_limit=4, lease_ttl=120)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"  # queued: its lease lasts a day

    def blip(*_a: object, **_k: object) -> None:
        raise StoreUnavailable("redis", "redis://", "connection reset")

    with monkeypatch.context() as m:
        m.setattr(rt.ports.leases, "release_leases", blip)
        cancel_flow.cancel(rt.ports, "b")  # committed; its lease not dropped, its job not revoked
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=False)  # "fill the gaps"
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"
    now = rt.ports.clock()
    ends = dict(rt.redis.client.zrange(rt.redis.keys.deferrals("b", "idempotent"), 0, -1, withscores=True))
    assert list(ends) == ["ch1:s1:audio"]
    assert 0 < ends["ch1:s1:audio"] - now <= 120 + 1
