"""A Redis that may evict keys is named when a worker starts, and a full one is said to be full (a private
redis-server: the machine's is shared, and these tests change its memory settings)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.domain.keys import Keyspace
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.worker import app
from tests.support.private_redis import PrivateRedis


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PrivateRedis]:
    with PrivateRedis(tmp_path / "redis") as started:
        yield started


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "volatile-ttl"])
def test_a_worker_starting_names_a_redis_that_may_evict_keys(server, policy, capsys) -> None:
    """Old code: nothing said so; the hunt's evicted leases were logged as 'a Redis loss?'."""
    redis.Redis.from_url(server.url).config_set("maxmemory-policy", policy)
    app.warn_of_an_evicting_redis([server.url, server.url])
    said = capsys.readouterr().err
    assert said.count(f"maxmemory-policy {policy}") == 1 and "noeviction" in said, said


def test_a_worker_starting_says_nothing_of_a_redis_that_evicts_nothing_or_does_not_answer(server, capsys) -> None:
    redis.Redis.from_url(server.url).config_set("maxmemory-policy", "noeviction")
    app.warn_of_an_evicting_redis([server.url])
    server.stop()
    app.warn_of_an_evicting_redis([server.url])  # down: its jobs wait for it as for any outage
    assert capsys.readouterr().err == ""


def test_a_write_refused_by_a_full_redis_says_redis_is_full(server) -> None:
    """Old code: 'redis unavailable at ...: OOM command not allowed ...', read as an outage."""
    store = RedisConnection(server.url, Keyspace("oom"))
    admin = redis.Redis.from_url(server.url)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        with pytest.raises(StoreUnavailable, match="Redis is full: its maxmemory reached"):
            store.run(lambda: store.client.set("oom:k", "v"))
    finally:
        admin.config_set("maxmemory", 0)
    store.run(lambda: store.client.set("oom:k", "v"))  # it takes writes again
