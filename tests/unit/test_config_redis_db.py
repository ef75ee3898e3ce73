"""The database `?db=N` of ANIMASTOR_REDIS_URL names is the broker's too, and a URL naming two databases is refused.

*Why:* redis-py and the result store read `?db=5`, but the broker derived from the URL dropped it: kombu kept the
queues (and its `unacked` hashes) in db 0, shared with any other farm or Celery app put there.
"""

from __future__ import annotations

import pytest
import redis
from kombu import Connection

from animastor_tasks.config import Settings
from animastor_tasks.errors import ConfigError


@pytest.mark.parametrize(
    ("redis_url", "broker_url"),
    [
        ("redis://127.0.0.1:6379?db=5", "redis://127.0.0.1:6379/5"),
        ("redis://127.0.0.1:6379/?db=5&socket_timeout=3", "redis://127.0.0.1:6379/5"),
        ("redis://127.0.0.1:6379/5?db=5", "redis://127.0.0.1:6379/5"),
        ("redis://127.0.0.1:6379?password=pw&db=4", "redis://:pw@127.0.0.1:6379/4"),
        (
            "rediss://:pw@r.example:6380?db=3&ssl_cert_reqs=required",
            "rediss://:pw@r.example:6380/3?ssl_cert_reqs=required",
        ),
    ],
)
def test_the_broker_derived_from_the_redis_url_uses_its_query_database(redis_url: str, broker_url: str) -> None:
    settings = Settings.from_env({"ANIMASTOR_REDIS_URL": redis_url})
    assert settings.broker_url == broker_url
    runtime_db = redis.ConnectionPool.from_url(settings.redis_url).connection_kwargs.get("db", 0)
    assert int(Connection(settings.broker_url).virtual_host.strip("/") or 0) == int(runtime_db)


@pytest.mark.parametrize(
    "url", ["redis://:hunter2@127.0.0.1:6379/0?db=5", "rediss://:hunter2@r:6380/2?db=3&ssl_cert_reqs=required"]
)
def test_a_redis_url_whose_path_and_query_name_different_databases_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match=r"ANIMASTOR_REDIS_URL=.*database") as info:
        Settings.from_env({"ANIMASTOR_REDIS_URL": url})
    assert "hunter2" not in str(info.value)
