"""A task-running process opens its connections before its first task, and a store that is down
at start fails nothing (the first task connects instead). Real Postgres, Redis and broker."""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import replace
from typing import Any

import pytest
from celery import Celery

from animastor_tasks.config import Settings
from animastor_tasks.worker import warm, wiring
from animastor_tasks.worker.celery_config import build_config


def test_the_warm_up_leaves_a_postgres_and_a_broker_connection_open(rt: Any) -> None:
    app = rt.ports.publisher.app
    assert rt.db._pool is None or rt.db._pool.get_stats()["pool_available"] == 0
    warm.warm_up(app).join(10)
    assert rt.db._pool.get_stats()["pool_available"] >= 1
    with app.producer_or_acquire() as producer:  # the pooled producer the warm-up connected
        assert producer.connection.connected


def test_the_warm_up_makes_the_job_paths_reads_and_writes_nothing(
    rt: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    for port, method in (("generators", "load"), ("jobs", "starting"), ("assets", "gate_candidates")):
        real = getattr(getattr(rt.ports, port), method)
        monkeypatch.setattr(getattr(rt.ports, port), method, _recorded(calls, f"{port}.{method}", real))
    epoch = rt.redis.keys.epoch()
    rt.redis.client.set(epoch, "before")  # the one key a first snapshot may write (SETNX): here already
    there = sorted(rt.redis.client.scan_iter())  # the epoch, and reconcile's bookmark (the fixture's)
    with caplog.at_level(logging.DEBUG, logger="animastor.worker"):
        warm.warm_up(rt.ports.publisher.app).join(10)
    assert [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()] == []
    assert sorted(rt.redis.client.scan_iter()) == there and epoch in there
    with rt.db.read() as conn:
        rows = conn.execute(
            "SELECT (SELECT count(*) FROM events) + (SELECT count(*) FROM asset_states)"
            " + (SELECT count(*) FROM job_starts) + (SELECT count(*) FROM books)"
        ).fetchone()[0]
    assert rows == 0
    stages = len(rt.ports.settings.registry.stages)
    assert sorted(calls) == sorted(["jobs.starting", "assets.gate_candidates"] + ["generators.load"] * stages)


def _recorded(calls: list[str], name: str, real: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return real(*args, **kwargs)

    return call


def test_stores_that_are_down_at_start_fail_nothing(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    down = "127.0.0.1:9"  # discard port: nothing listens
    broken = Settings.from_env(
        {
            "ANIMASTOR_DATABASE_URL": f"postgresql://postgres@{down}/none",
            "ANIMASTOR_REDIS_URL": f"redis://{down}/0",
            "ANIMASTOR_BROKER_URL": f"redis://{down}/0",
        }
    )
    app = Celery("warm-test", set_as_current=False)
    app.conf.update(build_config(broken))
    monkeypatch.setattr(wiring, "current", lambda: wiring.build(broken, app))
    with caplog.at_level(logging.WARNING, logger="animastor.worker"):
        thread = warm.warm_up(app)
        thread.join(30)
    assert not thread.is_alive()
    said = [r.getMessage() for r in caplog.records]
    assert any("warm-up: postgres not reachable yet" in m for m in said), said
    assert any("warm-up: broker not reachable yet" in m for m in said), said


def test_a_pool_child_starts_at_once_while_redis_takes_connections_and_never_answers(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool child read the Redis epoch before it told its parent it was up: with Redis cut off (a partition
    that drops packets, here a listener that never answers), that read waited out its timeouts, past Celery's
    `worker_proc_alive_timeout` (4 s), and the parent killed and forked the child again, for as long as the
    partition lasted. The read is the warm-up's now, in the background."""
    from animastor_tasks.worker import app as worker_app

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # connections complete in the kernel's backlog; nothing ever reads them
        hanging = replace(settings, redis_url=f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        built = wiring.build(hanging, worker_app.app)
        monkeypatch.setattr(wiring, "current", lambda: built)
        monkeypatch.setattr(wiring, "reset", lambda: None)
        started = time.monotonic()
        worker_app.fresh_connections()
        assert time.monotonic() - started < 2.0
