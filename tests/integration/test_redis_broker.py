"""The Redis broker transport (adapters/redis_broker.py) on a real Redis: one client per channel
and pool, every message delivered, a new client once kombu drops its pool. Events through it:
test_job_chain.py hears a kept job's events off the broker's event exchange."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import redis
from kombu import Connection, Exchange, Queue

from animastor_tasks.adapters.redis_broker import Channel
from animastor_tasks.config import Settings
from animastor_tasks.worker.celery_config import REDIS_BROKER_TRANSPORT, build_config


def _counting_clients(monkeypatch: Any) -> list[int]:
    made: list[int] = []
    real = redis.Redis.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "__init__", counted)
    return made


def test_a_redis_url_gets_the_shared_client_transport_and_other_schemes_keep_kombus(settings: Settings) -> None:
    assert build_config(replace(settings, broker_url="redis://127.0.0.1:6379/3"))["broker_transport"] == (
        REDIS_BROKER_TRANSPORT
    )
    for url in ("amqp://guest:guest@127.0.0.1:5672//", "rediss://127.0.0.1:6380/0"):
        assert build_config(replace(settings, broker_url=url))["broker_transport"] is None


def test_many_messages_are_sent_through_one_client_and_all_arrive(settings: Settings, monkeypatch: Any) -> None:
    name = f"t-broker-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    with Connection(settings.redis_url, transport=REDIS_BROKER_TRANSPORT) as conn:
        channel = conn.default_channel
        assert isinstance(channel, Channel)
        assert conn.as_uri().startswith("redis://"), "logs name the broker as operators wrote it"
        bound = queue(channel)
        bound.declare()
        try:
            made = _counting_clients(monkeypatch)
            producer = conn.Producer(channel)
            for n in range(50):
                producer.publish({"n": n}, exchange=queue.exchange, routing_key=name, declare=[queue])
            assert len(made) <= 1, "one client for the channel, not one per message"
            got = []
            while (message := bound.get(no_ack=True)) is not None:
                got.append(message.payload["n"])
            assert got == list(range(50))
        finally:
            bound.delete()


def test_a_dropped_pool_gets_a_new_client_on_the_new_pool(settings: Settings) -> None:
    with Connection(settings.redis_url, transport=REDIS_BROKER_TRANSPORT) as conn:
        channel = conn.default_channel
        first = channel._create_client()
        assert channel._create_client() is first
        channel._disconnect_pools()  # what kombu does after a connection error
        second = channel._create_client()
        assert second is not first
        assert second.connection_pool is channel.pool
        assert second.ping()
