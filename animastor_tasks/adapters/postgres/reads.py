"""Reads for operators (status views, the metrics exporter): never on a hot path."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from animastor_tasks.adapters.postgres.literals import GENERATING, IN_FLIGHT_STATES
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.domain.vocabulary import CommandStatus

# A count for the exporter or a view ends within this, answered or refused (StoreUnavailable): a scrape must end
# inside Prometheus' 10 s, and one count queued behind a lock (a migration's, an ALTER's) held it past that, every
# series going stale and `animastor_store_up` with them.
COUNT_SECONDS = 4


class OperatorReads:
    def __init__(self, db: Database) -> None:
        self.db = db

    @contextmanager
    def _bounded(self) -> Iterator[psycopg.Connection]:
        with self.db.transaction() as conn:
            conn.execute(f"SET LOCAL statement_timeout = {COUNT_SECONDS * 1000}")
            yield conn

    def clock(self) -> float:
        """Postgres's time now (Unix seconds): what the ages of its rows (`created_at`) are measured against. *Why:*
        measured against this host's clock, a command 70 s old read 0:00 from a host 150 s behind, 3:42 ahead."""
        with self.db.read() as conn:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()
        return float(row[0]) if row else 0.0

    # The states written into the text (literals.py): passed as a parameter, a generic plan scanned every pair.
    def lane_usage(self) -> dict[str, int]:
        """Generating pairs per stage, across every book: their partial index, not the table."""
        with self._bounded() as conn:
            return dict(
                conn.execute(f"SELECT stage, count(*) FROM asset_states WHERE state = {GENERATING} GROUP BY stage")
            )

    def pairs_in_flight(self) -> dict[tuple[str, str], int]:
        """{(stage, state): pairs} of the pending and generating pairs across every book, exact, read from their
        partial index: what a scrape costs grows with the work in flight, not with the farm's pairs."""
        with self._bounded() as conn:
            rows = conn.execute(
                f"SELECT stage, state, count(*) FROM asset_states WHERE state IN {IN_FLIGHT_STATES}"
                " GROUP BY stage, state"
            ).fetchall()
        return {(str(stage), str(state)): int(n) for stage, state, n in rows}

    def pairs_by_state(self) -> dict[tuple[str, str], int]:
        """{(stage, state): pairs} across every book: a scan of every pair (150-250 ms at 1.7M pairs, past the
        bound at tens of millions), which the exporter makes only now and then (operator/metrics.py)."""
        with self._bounded() as conn:
            rows = conn.execute("SELECT stage, state, count(*) FROM asset_states GROUP BY stage, state").fetchall()
        return {(str(stage), str(state)): int(n) for stage, state, n in rows}

    def command_status_counts(self) -> dict[CommandStatus, int]:
        """Commands per status, every status present (zero when none)."""
        with self._bounded() as conn:
            rows = dict(conn.execute("SELECT status, count(*) FROM commands GROUP BY status").fetchall())
        return {status: int(rows.get(str(status), 0)) for status in CommandStatus}
