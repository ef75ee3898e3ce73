"""What the exporter's pair counts cost Postgres: every scrape counted every pair (a parallel scan of asset_states,
150-250 ms at 1.7M pairs, past its 4 s bound at 30-40M and then `animastor_store_up{store="postgres"}` 0 with
Postgres fine). The pairs in flight are counted exactly on each scrape through their partial index; the idle ones
(dirty, ready, failed) by a full count made now and then. Real Postgres and Redis."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import psycopg
from prometheus_client import CollectorRegistry, generate_latest

from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.adapters.postgres.reads import OperatorReads
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import regenerate
from animastor_tasks.operator import metrics
from animastor_tasks.worker.wiring import Wiring
from tests.integration.helpers import advertise

from . import make_book
from .test_metrics import Samples, parse, value


class OneTransaction:
    """Stands in for the pool: every read in one transaction, whose table statistics the test reads."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        yield self.conn


def fetched(conn: psycopg.Connection) -> int:
    """Rows of asset_states read in this transaction so far."""
    row = conn.execute(
        "SELECT coalesce(sum(seq_tup_read), 0) + coalesce(sum(idx_tup_fetch), 0)"
        " FROM pg_stat_xact_user_tables WHERE relname = 'asset_states'"
    ).fetchone()
    assert row is not None
    return int(row[0])


class Clock:
    """Moves a millisecond on each reading, and further when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def scrape(registry: CollectorRegistry) -> Samples:
    return parse(generate_latest(registry).decode())


def test_a_scrape_counts_the_pairs_in_flight_and_the_idle_ones_only_now_and_then(rt: Wiring, monkeypatch) -> None:
    rt.catalog.import_book(make_book("big", scenes=500))  # 1,000 pairs, dirty
    advertise(rt, "gpu.audio")
    regenerate.regenerate(rt.ports, "big", ["audio"], [["ch1", "s1"], ["ch1", "s2"]])
    with rt.db.transaction() as conn:
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE stage = 'image' AND scene_id LIKE 's1%'")
    clock = Clock()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.AnimastorCollector(lambda: rt, clock=clock))
    with psycopg.connect(rt.settings.database_url) as conn:
        monkeypatch.setattr(rt, "reads", OperatorReads(cast(Database, OneTransaction(conn))))
        first = scrape(registry)
        assert fetched(conn) >= 1000  # the first scrape counts them all
        assert value(first, "animastor_pairs", stage="image", state="ready") == 111
        assert value(first, "animastor_pairs", stage="image", state="dirty") == 389
        in_flight = {s: value(first, "animastor_pairs", stage="audio", state=s) for s in ("pending", "generating")}
        assert sum(in_flight.values()) == 2

        regenerate.regenerate(rt.ports, "big", ["audio"], [["ch1", "s3"]])
        with rt.db.transaction() as other:
            other.execute("UPDATE asset_states SET state = 'ready' WHERE stage = 'image' AND scene_id = 's2'")
        before = fetched(conn)
        second = scrape(registry)
        assert fetched(conn) - before <= 10, "a scrape read the idle pairs again"
        moved = {s: value(second, "animastor_pairs", stage="audio", state=s) for s in ("pending", "generating")}
        assert sum(moved.values()) == 3  # in flight: exact on every scrape
        assert value(second, "animastor_pending_pairs", stage="audio") == moved["pending"]
        assert value(second, "animastor_pairs", stage="image", state="ready") == 111  # idle: as last counted
        assert value(second, "animastor_pairs", stage="audio", state="dirty") == 498

        clock.now += 60  # well past a few hundred times the last full count's duration
        third = scrape(registry)
        assert value(third, "animastor_pairs", stage="image", state="ready") == 112
        assert value(third, "animastor_pairs", stage="audio", state="dirty") == 497


def test_an_idle_count_past_its_bound_leaves_out_its_series_and_waits_before_the_next(rt: Wiring, monkeypatch) -> None:
    """A full count refused (past COUNT_SECONDS at tens of millions of pairs) took the pair and command families
    with it and reported Postgres down; now only the idle series go, and the count is not tried on every scrape."""
    rt.catalog.import_book(make_book("b", scenes=2))
    tries: list[float] = []

    def too_slow() -> dict[tuple[str, str], int]:
        tries.append(clock.now)
        clock.now += 4  # the count's bound, spent
        raise StoreUnavailable("canceling statement due to statement timeout")

    clock = Clock()
    monkeypatch.setattr(rt.reads, "pairs_by_state", too_slow)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.AnimastorCollector(lambda: rt, clock=clock))
    samples = scrape(registry)
    assert value(samples, "animastor_store_up", store="postgres") == 1
    assert value(samples, "animastor_pairs", stage="audio", state="pending") == 0
    assert value(samples, "animastor_pending_pairs", stage="audio") == 0
    assert value(samples, "animastor_commands", status="active") == 0
    assert not any(k[0] == "animastor_pairs" and ("state", "dirty") in k[1] for k in samples)
    clock.now += 60
    scrape(registry)
    assert len(tries) == 1  # not again within a few hundred times what it cost
    clock.now += 4 * metrics.IDLE_COUNT_SPACING
    scrape(registry)
    assert len(tries) == 2


def test_the_in_flight_count_reads_its_partial_index_under_a_generic_plan(rt: Wiring) -> None:
    rt.catalog.import_book(make_book("b", scenes=300))
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        reads: Any = OperatorReads(cast(Database, OneTransaction(conn)))
        for _ in range(3):
            before = fetched(conn)
            assert reads.pairs_in_flight() == {} and reads.lane_usage() == {}
            assert fetched(conn) == before
