"""Test stores: a database of its own per run, a Redis db of its own, cleaned around each test.

The environment is set at import time, before any test imports the Celery app, so
worker subprocesses started by end-to-end tests inherit exactly the same stores.
Where no Postgres/Redis is reachable (a fresh machine), `animastor_tasks.dev.stores` starts local ones.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

_RUN = uuid.uuid4().hex[:8]


def _configure_environment() -> None:
    if os.environ.get("ANIMASTOR_TEST_CONFIGURED") == "1":
        return
    from animastor_tasks.dev.probes import ensure_database, with_database
    from animastor_tasks.dev.stores import ensure_stores

    base = {
        "ANIMASTOR_DATABASE_URL": os.environ.get(
            "ANIMASTOR_TEST_DATABASE_URL", f"postgresql://postgres@127.0.0.1:5432/animastor_test_{_RUN}"
        ),
        "ANIMASTOR_REDIS_URL": os.environ.get("ANIMASTOR_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
    }
    overrides, lines = ensure_stores(base, log=lambda _: None)
    env = {**base, **overrides}
    if "ANIMASTOR_DATABASE_URL" in overrides:
        # A local embedded server: give this run its own database on it as well.
        env["ANIMASTOR_DATABASE_URL"] = with_database(overrides["ANIMASTOR_DATABASE_URL"], f"animastor_test_{_RUN}")
    ensure_database(env["ANIMASTOR_DATABASE_URL"])
    env.setdefault("ANIMASTOR_BROKER_URL", os.environ.get("ANIMASTOR_TEST_BROKER_URL", env["ANIMASTOR_REDIS_URL"]))
    env["ANIMASTOR_KEY_PREFIX"] = f"t{_RUN}"
    env["ANIMASTOR_TEST_CONFIGURED"] = "1"
    env["ANIMASTOR_TEST_STORES"] = " | ".join(lines)
    os.environ.update(env)


_configure_environment()


@pytest.fixture(scope="session")
def settings():  # type: ignore[no-untyped-def]
    from animastor_tasks.config import Settings

    return Settings.from_env()


@pytest.fixture(scope="session")
def migrated(settings):  # type: ignore[no-untyped-def]
    from animastor_tasks.adapters.postgres.migrations import migrate
    from animastor_tasks.adapters.postgres.pool import Database

    db = Database(settings.database_url)
    migrate(db)
    yield db
    db.close()
    from animastor_tasks.dev.probes import drop_database

    drop_database(settings.database_url)


TABLES = "events, artifacts, cancel_tombstones, command_targets, commands, asset_states, scenes, chapters, books"


@pytest.fixture
def clean_stores(settings, migrated) -> Iterator[None]:  # type: ignore[no-untyped-def]
    import redis

    with migrated.transaction() as conn:
        conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    client = redis.Redis.from_url(settings.redis_url)
    client.flushdb()
    client.close()
    yield


@pytest.fixture
def rt(settings, clean_stores):  # type: ignore[no-untyped-def]
    """This process's wiring on the test stores (its `ports` for the flows, its raw stores for
    assertions), publishing real Celery messages to the real broker."""
    from animastor_tasks.worker import wiring

    wiring.reset()
    yield wiring.current()
    wiring.reset()
