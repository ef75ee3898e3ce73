"""A task-running process opens its connections before its first task, and a store that is down
at start fails nothing (the first task connects instead). Real Postgres, Redis and broker."""

from __future__ import annotations

import logging
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
