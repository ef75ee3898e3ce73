"""Builds one process's adapters once and hands the flows their ports.

A Celery worker's pool child and the beat get theirs through `current()`, rebuilt after
a fork so no connection ever crosses one; the CLI, the exporter, tests and benchmarks
call `build()` and close what they built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from celery import Celery

from animastor_tasks.adapters.artifacts import artifact_store
from animastor_tasks.adapters.broker_probe import BrokerProbe
from animastor_tasks.adapters.celery_publisher import CeleryPublisher
from animastor_tasks.adapters.postgres.assets import AssetStore
from animastor_tasks.adapters.postgres.catalog import Catalog
from animastor_tasks.adapters.postgres.commands import CommandStore
from animastor_tasks.adapters.postgres.jobs import JobStore
from animastor_tasks.adapters.postgres.journal import Journal
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.adapters.postgres.reads import OperatorReads
from animastor_tasks.adapters.redis.breaker import BreakerStore
from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.adapters.redis.counters import CounterStore
from animastor_tasks.adapters.redis.deferrals import DeferralStore
from animastor_tasks.adapters.redis.leases import LeaseStore
from animastor_tasks.adapters.redis.locks import LockStore
from animastor_tasks.adapters.redis.presence import PresenceStore
from animastor_tasks.adapters.redis.state import BookStateStore
from animastor_tasks.config import Settings
from animastor_tasks.domain.keys import Keyspace
from animastor_tasks.generators import EntryPointGenerators
from animastor_tasks.ports import Ports
from animastor_tasks.worker.celery_config import build_config
from animastor_tasks.worker.time_limit import TimeLimitedArtifacts, TimeLimitedGenerators


@dataclass
class Wiring:
    """The ports, and the few concrete adapters that operators' reads and heartbeats use beside them."""

    ports: Ports
    db: Database
    redis: RedisConnection
    catalog: Catalog
    presence: PresenceStore
    counters: CounterStore
    breaker: BreakerStore
    deferrals: DeferralStore
    reads: OperatorReads

    @property
    def settings(self) -> Settings:
        return self.ports.settings

    def close(self) -> None:
        self.counters.close()
        self.db.close()
        self.redis.close()


def build(settings: Settings, app: Celery | None = None, *, db_wait: float = 5.0) -> Wiring:
    """Every adapter for `settings`; jobs are published through `app`, else through a Celery app
    configured from the same settings (a CLI or a test stack publishes to its own broker). `db_wait`: how long
    a Postgres read waits for a connection before the store counts as down."""
    if app is None:
        app = Celery("animastor_tasks", set_as_current=False)
        app.conf.update(build_config(settings))
    db = Database(settings.database_url, max_size=settings.db_pool_max, timeout=db_wait)
    conn = RedisConnection(settings.redis_url, Keyspace(settings.key_prefix))
    catalog = Catalog(db, settings.registry)
    presence = PresenceStore(conn, settings.broker_url if settings.broker_is_amqp else None)
    counters = CounterStore(conn)
    breaker = BreakerStore(conn)
    deferrals = DeferralStore(conn)
    ports = Ports(
        settings=settings,
        catalog=catalog,
        commands=CommandStore(db),
        assets=AssetStore(db),
        jobs=JobStore(db),
        journal=Journal(db),
        book_state=BookStateStore(conn),
        deferrals=deferrals,
        leases=LeaseStore(conn),
        breaker=breaker,
        presence=presence,
        counters=counters,
        locks=LockStore(conn),
        publisher=CeleryPublisher(app, counters),
        queue_probe=BrokerProbe(settings.broker_url),
        artifacts=TimeLimitedArtifacts(artifact_store(settings), settings.job_soft_time_limit),
        generators=TimeLimitedGenerators(EntryPointGenerators(settings), settings.job_soft_time_limit),
        clock=conn.server_time,
    )
    return Wiring(ports, db, conn, catalog, presence, counters, breaker, deferrals, OperatorReads(db))


_current: Wiring | None = None
_current_pid = 0


def current() -> Wiring:
    """This worker or beat process's wiring; rebuilt in a forked child so nothing crosses a fork."""
    global _current, _current_pid
    if _current is None or _current_pid != os.getpid():
        from animastor_tasks.worker.app import app

        _current = build(Settings.from_env(), app)
        _current_pid = os.getpid()
    return _current


def reset() -> None:
    """Forget this process's wiring (a fresh pool child, or a test that switches stores)."""
    global _current
    if _current is not None and _current_pid == os.getpid():
        _current.close()
    _current = None
