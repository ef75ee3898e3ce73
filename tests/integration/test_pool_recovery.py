"""A Postgres restart costs one failed transaction per process, not one per pooled connection (real Postgres: the
pool's backends are ended by `pg_terminate_backend`, as a restart or a failover ends them)."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import psycopg
import pytest

from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.errors import StoreUnavailable

POOLED = 4


def _fill_pool(db: Database) -> list[int]:
    """POOLED connections opened at once and given back idle; their backends' pids."""
    with ExitStack() as held:
        conns = [held.enter_context(db.read()) for _ in range(POOLED)]
        return [conn.info.backend_pid for conn in conns]


def _end_backends(url: str, pids: list[int]) -> None:
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
        ended = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)).fetchone()
        assert ended is not None
        for _ in range(100):  # ending is asynchronous: wait until the server has let them go
            if admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)).fetchone() == (0,):
                return
            threading.Event().wait(0.02)
        raise AssertionError("the backends did not end")


@pytest.mark.parametrize("how", ["read", "transaction"])
def test_after_the_backends_end_only_the_first_transaction_fails(settings, migrated, how: str) -> None:
    db = Database(settings.database_url, max_size=POOLED)
    try:
        pids = _fill_pool(db)
        assert len(set(pids)) == POOLED
        _end_backends(settings.database_url, pids)
        outcomes = []
        for _ in range(POOLED):
            try:
                with getattr(db, how)() as conn:
                    conn.execute("SELECT 1").fetchone()
                outcomes.append("ok")
            except StoreUnavailable:
                outcomes.append("failed")
        assert outcomes == ["failed"] + ["ok"] * (POOLED - 1)
    finally:
        db.close()


def _conninfo(db: Database) -> dict[str, str | None]:
    with db.read() as conn:
        return {o.keyword.decode(): None if o.val is None else o.val.decode() for o in conn.pgconn.info}


def test_a_pooled_connection_gives_up_on_a_server_that_stopped_answering(settings, migrated) -> None:
    """Keepalive probes after 10 s without traffic and 30 s at most of unacknowledged data, unless the URL says
    otherwise. *Why:* on libpq's defaults a query sent across a partition that drops packets waited on TCP's own
    retries (two hours before the first keepalive probe; about 15 minutes of retransmissions)."""
    db = Database(settings.database_url)
    try:
        given = _conninfo(db)
    finally:
        db.close()
    assert (given["keepalives_idle"], given["keepalives_interval"], given["keepalives_count"]) == ("10", "5", "3")
    assert given["tcp_user_timeout"] == "30000" and given["keepalives"] == "1", given
    joined = "&" if "?" in settings.database_url else "?"
    db = Database(f"{settings.database_url}{joined}tcp_user_timeout=5000&keepalives_idle=7")
    try:
        given = _conninfo(db)
    finally:
        db.close()
    assert (given["tcp_user_timeout"], given["keepalives_idle"], given["keepalives_count"]) == ("5000", "7", "3")
