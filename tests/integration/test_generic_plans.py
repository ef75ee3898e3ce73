"""The statements on a job's path settle on a generic plan: the server stops planning them.

Real Postgres. A statement psycopg has prepared (after `prepare_threshold` runs) is planned for its
values for its first five runs; after that the server keeps a generic plan when it costs about as
much. A state or a status passed as a parameter cannot match a partial index in a generic plan, so
those statements were planned afresh on every run (0.1-0.8 ms each). Counted by the server itself
(`pg_prepared_statements`) on a pool of one connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from animastor_tasks.adapters.postgres.assets import AssetStore
from animastor_tasks.adapters.postgres.jobs import JobStore
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import advertise, make_book

RUNS = 12


@pytest.fixture
def one_connection(rt: Any) -> Any:
    db = Database(rt.settings.database_url, max_size=1)
    yield db
    db.close()


def plans(db: Database, prefix: str) -> tuple[int, int]:
    """(generic, custom) plans the connection made for the prepared statement that starts with `prefix`."""
    with db.read() as conn:
        rows = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
            (prefix + "%",),
        ).fetchall()
    assert len(rows) == 1, rows
    return int(rows[0][0]), int(rows[0][1])


def run(times: int, call: Callable[[], object]) -> None:
    for _ in range(times):
        call()


def test_the_refill_read_the_claim_counts_and_the_job_start_read_run_on_generic_plans(
    rt: Any, one_connection: Database
) -> None:
    rt.catalog.import_book(make_book("b1", chapters=2, scenes=40))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b1", ["audio"])
    assets, jobs = AssetStore(one_connection), JobStore(one_connection)

    def claim_counts() -> None:
        with assets.claiming("b1", {"audio": "gpu.audio"}, {"audio": ["b2"]}):
            pass

    def start_read() -> None:
        with jobs.starting("b1", ("ch1", "s1", "audio")) as start:
            assert start.row is not None

    run(RUNS, lambda: assets.gate_candidates("b1", ["audio"], 16))
    run(RUNS, claim_counts)
    run(RUNS, start_read)
    counted = {
        p: plans(one_connection, p) for p in ("WITH cmd AS", "SELECT stage, NULL", "SELECT a.state, a.fencing_token")
    }
    # Prepared after 5 runs, planned for its values 5 times, then generic: nothing planned since.
    assert {p: (generic >= RUNS - 10 and custom <= 5) for p, (generic, custom) in counted.items()} == dict.fromkeys(
        counted, True
    ), f"(generic, custom) plans: {counted}"
