"""Reads for operators (status views, the metrics exporter): never on a hot path."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.domain.vocabulary import AssetState, CommandStatus

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

    def lane_usage(self) -> dict[str, int]:
        """Generating pairs per stage, across every book."""
        with self._bounded() as conn:
            return dict(
                conn.execute(
                    "SELECT stage, count(*) FROM asset_states WHERE state = %s GROUP BY stage",
                    (AssetState.GENERATING,),
                ).fetchall()
            )

    def pairs_by_state(self) -> dict[tuple[str, str], int]:
        """{(stage, state): pairs} across every book; the exporter's `animastor_pairs` (one GROUP BY per scrape)."""
        with self._bounded() as conn:
            rows = conn.execute("SELECT stage, state, count(*) FROM asset_states GROUP BY stage, state").fetchall()
        return {(str(stage), str(state)): int(n) for stage, state, n in rows}

    def command_status_counts(self) -> dict[CommandStatus, int]:
        """Commands per status, every status present (zero when none)."""
        with self._bounded() as conn:
            rows = dict(conn.execute("SELECT status, count(*) FROM commands GROUP BY status").fetchall())
        return {status: int(rows.get(str(status), 0)) for status in CommandStatus}
