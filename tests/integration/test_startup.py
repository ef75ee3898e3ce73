"""Processes refuse to start on bad settings, naming the variable, without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "program", [["celery", "-A", "animastor_tasks", "worker"], ["celery", "-A", "animastor_tasks", "beat"]]
)
def test_time_limits_out_of_order_stop_the_process(program: list[str]) -> None:
    env = {**os.environ, "ANIMASTOR_JOB_SOFT_TIME_LIMIT": "20", "ANIMASTOR_JOB_TIME_LIMIT": "10"}
    done = subprocess.run([sys.executable, "-m", *program], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    assert "ANIMASTOR_JOB_SOFT_TIME_LIMIT < ANIMASTOR_JOB_TIME_LIMIT < ANIMASTOR_VISIBILITY_TIMEOUT" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("variable", "value"),
    [("ANIMASTOR_OTEL", "true"), ("ANIMASTOR_STAGES", '{"audio": {"lane_limt": 2}}')],
)
def test_a_worker_with_a_misspelt_setting_stops_naming_it(variable: str, value: str) -> None:
    """`ANIMASTOR_OTEL=true` ran the worker without tracing, a misspelt stage limit ran it with the default."""
    env = {**os.environ, variable: value}
    program = [sys.executable, "-m", "celery", "-A", "animastor_tasks", "worker"]
    done = subprocess.run(program, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    assert variable in done.stderr and "Traceback" not in done.stderr


def test_a_postgres_that_refuses_the_connection_is_reported_with_its_reason() -> None:
    """A misspelt database, role or password read `couldn't get a connection after 5.00 sec`, as if Postgres
    were down: the reason was only in the pool's log lines."""
    cause = 'database "animastor_no_such_db" does not exist'
    url = os.environ["ANIMASTOR_DATABASE_URL"].rsplit("/", 1)[0] + "/animastor_no_such_db"
    env = {**os.environ, "ANIMASTOR_DATABASE_URL": url}
    program = [sys.executable, "-m", "animastor_tasks.operator.cli", "commands"]
    done = subprocess.run(program, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 3, done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert cause in error and "Traceback" not in done.stderr, done.stderr


_LEAVES_ITS_POOL_OPEN = """
import atexit, os
left = {}
# Registered before the pool module is imported, so it runs after that module's own exit hook.
atexit.register(lambda: print("pool at exit:", "closed" if left["db"]._pool is None else "open"))
from animastor_tasks.adapters.postgres.pool import Database
db = Database(os.environ["ANIMASTOR_DATABASE_URL"])
with db.read() as conn:
    conn.execute("SELECT 1")
left["db"] = db
"""


def test_a_process_that_leaves_its_pool_open_closes_it_on_its_way_out() -> None:
    """Python 3.13 cannot stop a pool's threads in the interpreter's last moments and waits 5 s for each: every
    CLI command (which never closed its pool) took 20 s more to exit, and a solo-pool worker 21 s to stop."""
    done = subprocess.run([sys.executable, "-c", _LEAVES_ITS_POOL_OPEN], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pool at exit: closed", (done.stdout, done.stderr)
    assert "couldn't stop thread" not in done.stderr, done.stderr
