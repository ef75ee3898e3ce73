"""The stores and seams one process works with, built once per process from settings."""

from __future__ import annotations

import os
from dataclasses import dataclass

from animastor_tasks.adapters.broker import ConsumerCounter, Publisher
from animastor_tasks.adapters.catalog import Catalog
from animastor_tasks.adapters.ledger import Ledger
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.adapters.redis.coordination import Coordination
from animastor_tasks.config import Settings
from animastor_tasks.domain.keys import Keyspace
from animastor_tasks.domain.outcomes import DeferralWindows


@dataclass
class Runtime:
    settings: Settings
    db: Database
    catalog: Catalog
    ledger: Ledger
    coord: Coordination
    consumers: ConsumerCounter
    publisher: Publisher | None = None

    @classmethod
    def build(cls, settings: Settings, publisher: Publisher | None = None) -> Runtime:
        db = Database(settings.database_url, max_size=settings.db_pool_max)
        coord = Coordination(settings.redis_url, Keyspace(settings.key_prefix))
        return cls(
            settings=settings,
            db=db,
            catalog=Catalog(db, settings.registry),
            ledger=Ledger(db),
            coord=coord,
            consumers=ConsumerCounter(coord, settings.broker_url if settings.broker_is_amqp else None),
            publisher=publisher,
        )

    @property
    def windows(self) -> DeferralWindows:
        return DeferralWindows(self.settings.capacity_defer_seconds, self.settings.idempotent_defer_seconds)

    def require_publisher(self) -> Publisher:
        if self.publisher is None:
            raise RuntimeError("this runtime was built without a publisher")
        return self.publisher

    def close(self) -> None:
        self.db.close()
        self.coord.close()


_current: Runtime | None = None
_current_pid = 0


def current(publisher: Publisher | None = None) -> Runtime:
    """The process-wide runtime; rebuilt in a forked child so nothing crosses a fork."""
    global _current, _current_pid
    if _current is None or _current_pid != os.getpid():
        _current = Runtime.build(Settings.from_env(), publisher)
        _current_pid = os.getpid()
    elif publisher is not None and _current.publisher is None:
        _current.publisher = publisher
    return _current


def reset() -> None:
    """Forget the process-wide runtime (settings changed, or a test switches stores)."""
    global _current
    if _current is not None and _current_pid == os.getpid():
        _current.close()
    _current = None
