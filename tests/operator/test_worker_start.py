"""A worker of a release the database is not migrated to refuses to start (real worker processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from animastor_tasks.adapters.postgres.migrations import migration_files

from . import operator_env

CLI = [sys.executable, "-m", "animastor_tasks.operator.cli"]


@pytest.mark.parametrize("worker", [["worker", "--stage", "audio"], ["worker"]], ids=["gpu", "control"])
def test_a_worker_started_before_db_migrate_exits_3_saying_what_to_run(tmp_path: Path, worker: list[str]) -> None:
    """Old code: a GPU worker upgraded before `db migrate` started, failed each job at its start and was handed it
    again, a pair dispatched 33 times a minute (found by an upgrade hunt)."""
    *_, (version, newest, _) = migration_files()
    with operator_env(tmp_path) as env:
        with psycopg.connect(env["ANIMASTOR_DATABASE_URL"], autocommit=True) as conn:  # one release back
            conn.execute("DELETE FROM schema_migrations WHERE version = %s", (version,))
        done = subprocess.run(
            [*CLI, *worker, "--without-mingle", "-n", f"w{tmp_path.name[-6:]}@%h"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 3, done.stderr[-2000:]
    assert "refusing to start" in done.stderr and "animastor-tasks db migrate" in done.stderr, done.stderr[-2000:]
    assert newest in done.stderr and "ready." not in done.stdout + done.stderr
