"""The Redis database each pytest-xdist worker of `make test` is given (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.conftest import redis_db_for_worker


@pytest.mark.parametrize(
    ("url", "index", "expected"),
    [
        ("redis://127.0.0.1:6379/15", 0, "redis://127.0.0.1:6379/15"),
        ("redis://127.0.0.1:6379/15", 1, "redis://127.0.0.1:6379/14"),
        ("rediss://:secret@cache:6380/0", 1, "rediss://:secret@cache:6380/15"),
        ("redis://127.0.0.1:6379", 2, "redis://127.0.0.1:6379/14"),
        ("unix:///tmp/x/redis.sock?db=0", 1, "unix:///tmp/x/redis.sock?db=15"),
        ("redis+socket:///tmp/x/redis.sock", 1, "redis+socket:///tmp/x/redis.sock?virtual_host=15"),
        ("amqp://guest:guest@127.0.0.1:5672//", 1, "amqp://guest:guest@127.0.0.1:5672//"),
    ],
)
def test_each_worker_gets_a_redis_database_of_its_own(url: str, index: int, expected: str) -> None:
    assert redis_db_for_worker(url, index) == expected
