"""A Postgres restart costs one failed transaction per process, not one per pooled connection (real Postgres: the
pool's backends are ended by `pg_terminate_backend`, as a restart or a failover ends them)."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from typing import cast
from urllib.parse import urlsplit

import psycopg
import pytest

from animastor_tasks.adapters.postgres.pool import Database, _Connection
from animastor_tasks.errors import StoreUnavailable
from tests.support.tcp_proxy import FreezingProxy

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


def test_a_server_that_takes_a_statement_and_never_answers_is_given_up_after_the_answer_limit(
    settings, migrated, monkeypatch
) -> None:
    """A hung proxy or pooler, a stopped server process: what is sent is acknowledged, so the keepalives and
    `tcp_user_timeout` see nothing wrong. Old code: the read waited for good (in a hunt, two GPU processes in a commit's
    and a refill's round trip held their slots idle 8 minutes, until the proxy was killed)."""
    monkeypatch.setattr(_Connection, "answer_limit", 1.0)
    where = urlsplit(settings.database_url)
    host, port = where.hostname or "127.0.0.1", where.port or 5432
    with FreezingProxy((host, port)) as proxy:
        db = Database(settings.database_url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}", 1), max_size=2)
        try:
            with db.read() as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
            proxy.frozen.set()
            said: list[str] = []

            def read() -> None:
                try:
                    with db.transaction() as conn:
                        conn.execute("SELECT 1")
                    said.append("answered")
                except StoreUnavailable as err:
                    said.append(str(err))

            started = time.monotonic()
            waiting = threading.Thread(target=read, daemon=True)
            waiting.start()
            waiting.join(20)
            assert said and "no answer from the server within 1s; connection ended" in said[0], said
            assert time.monotonic() - started < 5
            proxy.frozen.clear()
            with db.read() as conn:  # a connection of its own: the ended one was dropped
                assert conn.execute("SELECT 2").fetchone() == (2,)
        finally:
            proxy.frozen.clear()
            db.close()


def test_the_journal_s_prune_waits_past_the_answer_limit(settings, migrated, monkeypatch) -> None:
    """A backlog to delete (a lowered ANIMASTOR_JOURNAL_MAX_ROWS) may take longer than the limit: cut short, the
    prune was rolled back every pass, and the rest of reconcile's pass after it never ran (a review)."""
    from animastor_tasks.adapters.postgres.journal import Journal

    db = Database(settings.database_url, max_size=2)
    try:
        with db.transaction() as conn:  # connected before the limit shrinks: connecting is not an answer's wait
            conn.execute("SELECT 1")
        monkeypatch.setattr(_Connection, "answer_limit", 1e-6)  # no answer comes in a microsecond
        with pytest.raises(StoreUnavailable, match="no answer from the server within"), db.read() as conn:
            conn.execute("SELECT pg_sleep(0.05)")
        assert Journal(db).prune_journal(0, 10**9) >= 0
    finally:
        db.close()


def test_a_worker_s_migration_check_against_a_server_that_never_answers_ends_in_its_bound(settings, migrated) -> None:
    """A worker's start-up check (`missing_migrations`) behind a hung proxy: its connect went through, then the read
    waited for good, the worker never starting, not a word said (review of 2aaf597: a plain psycopg connect)."""
    from animastor_tasks.adapters.postgres.migrations import missing_migrations

    where = urlsplit(settings.database_url)
    host, port = where.hostname or "127.0.0.1", where.port or 5432
    with FreezingProxy((host, port)) as proxy:
        url = settings.database_url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}", 1)
        assert missing_migrations(url, within=2.0) == []  # migrated, answering
        proxy.frozen.set()
        said: list[object] = []
        started = time.monotonic()
        checking = threading.Thread(target=lambda: said.append(missing_migrations(url, within=1.0)), daemon=True)
        checking.start()
        checking.join(20)
        took = time.monotonic() - started
        proxy.frozen.clear()
    assert said == [None] and took < 6, (said, took)


@pytest.mark.timeout(60)
def test_a_start_check_against_a_server_that_never_answers_ends_well_before_the_answer_limit(
    settings, migrated, monkeypatch
) -> None:
    """Pause hunt: a GPU host's pooled connection through a hung pooler held a job's start check, and its slot, for
    the whole `ANSWER_LIMIT_S` (60 s) before the job was let go and the process paused; so did the paused process's
    ask whether Postgres answers. Both wait `START_ANSWER_LIMIT_S` at most (2 s here; the other transactions' limit
    stays 60 s), and the connection goes back to the pool with the usual limit."""
    from animastor_tasks.adapters.postgres import jobs as job_rows
    from animastor_tasks.adapters.postgres.pool import ANSWER_LIMIT_S

    monkeypatch.setattr(job_rows, "START_ANSWER_LIMIT_S", 2.0)
    where = urlsplit(settings.database_url)
    host, port = where.hostname or "127.0.0.1", where.port or 5432
    with FreezingProxy((host, port)) as proxy:
        db = Database(settings.database_url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}", 1), max_size=1)
        store = job_rows.JobStore(db)
        try:
            assert store.answers()  # a pooled connection now, as on a host that ran a job a moment ago
            with db.read() as conn:
                assert cast(_Connection, conn).answer_limit == ANSWER_LIMIT_S  # the ask's limit went with it
            proxy.frozen.set()
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="within 2s"), store.starting("nobook", ("ch1", "s1", "audio")):
                pass
            assert time.monotonic() - started < 10
            started = time.monotonic()
            assert not store.answers()
            assert time.monotonic() - started < 10
        finally:
            proxy.frozen.clear()
            db.close()
