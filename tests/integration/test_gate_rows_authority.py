"""The gate's SQL and the domain rule agree on which commands authorize (`domain.gate.commanded_pairs`)."""

from __future__ import annotations

import pytest

from animastor_tasks.domain.gate import CommandFact, commanded_pairs
from animastor_tasks.domain.vocabulary import CommandStatus
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book


@pytest.mark.parametrize("status", list(CommandStatus))
def test_gate_rows_authorize_exactly_what_the_domain_rule_does(rt: Wiring, status: CommandStatus) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # both pairs dispatched: in flight
    with rt.db.transaction() as conn:
        conn.execute("UPDATE commands SET status = %s WHERE book_id = 'b'", (status,))
    rows = rt.ports.assets.gate_rows("b")
    assert rows is not None and len(rows.in_flight) == 2
    raw = [CommandFact(status, "audio", frozenset({("ch1", "s1"), ("ch1", "s2")}))]
    assert rows.commanded == commanded_pairs(raw)
