"""The broker URL derived from ANIMASTOR_REDIS_URL logs in as the runtime's own Redis client does.

*Why:* redis-py reads a login from the query (`?password=`, `?username=`) and from a `unix://` URL's authority;
kombu reads neither there (a `?password=` even breaks its Connection), and the derived broker URL dropped them:
the broker connected without the password.
"""

from __future__ import annotations

import pytest
from celery import Celery
from kombu import Connection
from kombu.utils.url import url_to_parts

from animastor_tasks.config import Settings, redis_py_url, result_backend_url


def _login(redis_url: str) -> tuple[str | None, str | None]:
    """(user, password) kombu logs in to the derived broker with; a socket's are read by its transport from the
    host part of the URL, as here."""
    broker = Connection(Settings.from_env({"ANIMASTOR_REDIS_URL": redis_url}).broker_url)
    if broker.hostname.startswith("socket://"):
        parts = url_to_parts(broker.hostname)
        return parts.username, parts.password
    return broker.userid, broker.password


@pytest.mark.parametrize(
    ("redis_url", "user", "password"),
    [
        ("redis://h:6379/0?password=x", None, "x"),
        ("redis://h:6379/0?password=a%2Fb%40c%3Ad&socket_timeout=5", None, "a/b@c:d"),
        ("redis://h:6379/0?username=ops&password=x", "ops", "x"),
        ("redis://ops@h:6379/0?password=x", "ops", "x"),
        ("redis://:netloc@h:6379/0?password=query", None, "netloc"),  # redis-py's precedence: the authority's
        ("rediss://h:6380/1?password=x&ssl_cert_reqs=none", None, "x"),
        ("unix:///run/redis.sock?db=2&password=x", None, "x"),
        ("unix://:x@/run/redis.sock?db=2", None, "x"),
        ("redis://h:6379/0", None, None),
    ],
)
def test_the_derived_broker_url_keeps_the_redis_login(redis_url: str, user: str | None, password: str | None) -> None:
    assert _login(redis_url) == (user, password)
    assert "password=" not in Settings.from_env({"ANIMASTOR_REDIS_URL": redis_url}).broker_url


def test_a_socket_broker_still_reads_as_its_redis_py_url() -> None:
    broker_url = Settings.from_env({"ANIMASTOR_REDIS_URL": "unix:///run/redis.sock?db=2&password=x"}).broker_url
    assert broker_url == "redis+socket://:x@/run/redis.sock?virtual_host=2"
    assert redis_py_url(broker_url) == "unix://:x@/run/redis.sock?db=2"


@pytest.mark.parametrize("redis_url", ["unix:///run/redis.sock?db=2&password=x", "unix://:x@/run/redis.sock?db=2"])
def test_a_socket_result_backend_keeps_the_password(redis_url: str) -> None:
    backend = Celery(backend=result_backend_url(redis_url), set_as_current=False).backend
    assert (backend.connparams["password"], backend.connparams["db"]) == ("x", 2)
