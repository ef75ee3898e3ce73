"""Versioned schema migrations shipped as `sql/NNNN_name.sql`."""

from __future__ import annotations

import logging
from importlib import resources

from animastor_tasks.adapters.postgres.pool import Database

log = logging.getLogger("animastor.postgres")

_MIGRATIONS_LOCK_ID = 0x616E696D  # advisory lock taken while migrating


def migration_files() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every migration shipped with the package, in order."""
    folder = resources.files("animastor_tasks.adapters.postgres") / "sql"
    found = []
    for entry in folder.iterdir():
        name = entry.name
        if name.endswith(".sql") and name[:4].isdigit():
            found.append((int(name[:4]), name, entry.read_text(encoding="utf-8")))
    return sorted(found)


def migrate(db: Database) -> list[str]:
    """Apply the migrations a database lacks; safe to run again and concurrently.

    Each migration commits on its own, so a table one of them locks is free again before the next
    starts (one transaction for all held 0006's lock on `asset_states` through every later one). A
    session advisory lock, held across them, makes a second migrate wait and then find nothing to do.
    """
    applied: list[str] = []
    with db.read() as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (_MIGRATIONS_LOCK_ID,))
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
            for version, name, sql in migration_files():
                if version in done:
                    continue
                with conn.transaction():
                    conn.execute(sql.encode())
                    conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (version, name))
                applied.append(name)
                log.info("[DB] applied migration %s", name)
        finally:
            if not conn.broken:
                conn.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATIONS_LOCK_ID,))
    return applied
