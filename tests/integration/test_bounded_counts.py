"""The exporter's counts end in time, answered or refused, whatever holds the tables they count."""

from __future__ import annotations

import threading
import time

import pytest

from animastor_tasks.adapters.postgres.reads import COUNT_SECONDS
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.worker.wiring import Wiring


@pytest.mark.parametrize("count", ["pairs_by_state", "pairs_in_flight", "command_status_counts", "lane_usage"])
def test_a_count_behind_a_table_lock_is_refused_within_its_bound(rt: Wiring, count: str) -> None:
    """A count queued behind a lock (a migration's ALTER TABLE holds one on asset_states) held the scrape past
    Prometheus' 10 s: every series went stale, `animastor_store_up` with them, and no store alert could fire."""
    table = "commands" if count == "command_status_counts" else "asset_states"
    outcome: list[object] = []
    with rt.db.transaction() as holder:
        holder.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")

        def read() -> None:
            try:
                outcome.append(getattr(rt.reads, count)())
            except Exception as err:  # what the exporter sees
                outcome.append(err)

        started = time.monotonic()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(COUNT_SECONDS + 3)
        waited = time.monotonic() - started
    reader.join(5)
    assert outcome, f"{count} still waiting after {waited:.1f} s"
    assert isinstance(outcome[0], StoreUnavailable) and "statement timeout" in str(outcome[0]), outcome
    assert waited < COUNT_SECONDS + 2
