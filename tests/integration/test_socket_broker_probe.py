"""Reconcile's look into a Redis broker on a unix socket (`redis+socket://`, the default broker of a `unix://`
coordination Redis): the messages are listed in the database kombu writes them to."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu import Connection, Exchange, Queue

from animastor_tasks.adapters.broker_probe import queued_dispatch_ids
from animastor_tasks.config import result_backend_url
from tests.support.private_redis import redis_server_executable


@pytest.fixture
def socket_redis(tmp_path: Path) -> Iterator[Path]:
    sock = tmp_path / "redis.sock"
    server = subprocess.Popen(
        [redis_server_executable(), "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sock.exists(), "redis-server did not open its socket"
        yield sock
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_job_waiting_in_a_socket_brokers_database_is_seen_as_queued(socket_redis: Path) -> None:
    """The probe listed database 0 whatever the URL's `virtual_host`: every job waiting in another database looked
    lost, so each reconcile dropped its lease and dispatched its pair again."""
    broker = result_backend_url(f"unix://{socket_redis}?db=2")  # the broker a `unix://` Redis URL defaults to
    queue = Queue("gpu.audio", Exchange("gpu.audio", type="direct"), routing_key="gpu.audio")
    with Connection(broker) as conn, conn.Producer() as producer:
        producer.publish({}, exchange=queue.exchange, routing_key="gpu.audio", declare=[queue], headers={"id": "d1"})
    assert redis.Redis(unix_socket_path=str(socket_redis), db=2).llen("gpu.audio") == 1  # where kombu wrote it
    assert queued_dispatch_ids(broker, ["gpu.audio"]) == {"d1"}
