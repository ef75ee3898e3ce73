"""A pass over a book of many pairs reads its Redis snapshot while its Postgres rows come back
(`gate.OVERLAP_PAIRS`, `flow/read_ahead.py`): the same decisions as reading them in turn, and a
store that fails meanwhile still authorizes nothing.

Real Postgres, Redis and broker. The threshold is moved so that a book of a few scenes crosses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from animastor_tasks.adapters.postgres.assets import AssetStore
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.flow import gate, read_ahead
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import make_book, states
from .test_elastic_share import lane


@pytest.fixture
def overlapped(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every pass reads beside its rows; the names of the reads sent to the reader thread."""
    sent: list[str] = []
    submit = read_ahead.submit

    def counted(read: Callable[[], Any]) -> Any:
        sent.append(getattr(read, "func", read).__name__)
        return submit(read)

    monkeypatch.setattr(gate, "OVERLAP_PAIRS", 1)
    monkeypatch.setattr(read_ahead, "submit", counted)
    return sent


@pytest.mark.parametrize("beside", [False, True])
def test_a_pass_decides_the_same_whether_its_snapshot_is_read_beside_its_rows_or_after(
    rt: Any, request: pytest.FixtureRequest, beside: bool
) -> None:
    sent = request.getfixturevalue("overlapped") if beside else []
    lane(rt, lane_limit=2)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # dispatches s1, s2; the rest wait for the lane
    report = gate.gate_pass(rt.ports, "b")
    assert report.authorized_count == 6 and report.dispatched == []
    assert report.outcomes == {"deferred_capacity": 4}  # the snapshot said why they wait
    assert sorted(p for p, s in states(rt, "b").items() if s == "generating") == [
        ("ch1", "s1", "audio"),
        ("ch1", "s2", "audio"),
    ]
    assert sent == (["_snapshot"] if beside else [])  # this pass's (the regenerate's came with its writes)


def test_postgres_unreachable_while_the_snapshot_is_read_beside_authorizes_nothing(
    rt: Any, overlapped: list[str]
) -> None:
    lane(rt, lane_limit=2)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    unreachable = Database("postgresql://postgres@127.0.0.1:1/none", timeout=1)
    try:
        report = gate.gate_pass(replace(rt.ports, assets=AssetStore(unreachable)), "b")
    finally:
        unreachable.close()
    assert report.error and "postgres unavailable" in report.error
    assert report.authorized == [] and report.dispatched == [] and overlapped.count("_snapshot") == 1
    assert gate.gate_pass(rt.ports, "b").error is None  # the reader thread is free for the next pass
