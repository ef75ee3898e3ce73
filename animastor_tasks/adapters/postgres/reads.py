"""Reads for operators (status views, the metrics exporter): never on a hot path."""

from __future__ import annotations

from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.domain.vocabulary import AssetState, CommandStatus


class OperatorReads:
    def __init__(self, db: Database) -> None:
        self.db = db

    def lane_usage(self) -> dict[str, int]:
        """Generating pairs per stage, across every book."""
        with self.db.read() as conn:
            return dict(
                conn.execute(
                    "SELECT stage, count(*) FROM asset_states WHERE state = %s GROUP BY stage",
                    (AssetState.GENERATING,),
                ).fetchall()
            )

    def pairs_by_state(self) -> dict[tuple[str, str], int]:
        """{(stage, state): pairs} across every book; the exporter's `animastor_pairs` (one GROUP BY per scrape)."""
        with self.db.read() as conn:
            rows = conn.execute("SELECT stage, state, count(*) FROM asset_states GROUP BY stage, state").fetchall()
        return {(str(stage), str(state)): int(n) for stage, state, n in rows}

    def command_status_counts(self) -> dict[CommandStatus, int]:
        """Commands per status, every status present (zero when none)."""
        with self.db.read() as conn:
            rows = dict(conn.execute("SELECT status, count(*) FROM commands GROUP BY status").fetchall())
        return {status: int(rows.get(str(status), 0)) for status in CommandStatus}
