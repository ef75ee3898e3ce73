"""A process's counters: held in memory, added to the shared hash by a writer thread in one pipeline.

Real Redis; a refused connection stands for a Redis that is down.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import pytest
import redis

from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.adapters.redis.counters import CounterStore, histogram_field
from animastor_tasks.dev.net import free_port
from animastor_tasks.domain.keys import Keyspace
from tests.support import wait_for


@pytest.fixture
def store(settings, clean_stores) -> Iterator[Callable[[float], CounterStore]]:  # type: ignore[no-untyped-def]
    """Stores on the test Redis; each one's writer stopped and connection closed at the end, pass or fail."""
    made: list[CounterStore] = []

    def make(flush_seconds: float) -> CounterStore:
        made.append(CounterStore(RedisConnection(settings.redis_url, Keyspace(settings.key_prefix)), flush_seconds))
        return made[-1]

    yield make
    for counters in made:
        counters.close()
        counters.conn.close()


def field(counters: CounterStore, name: str) -> int:
    return int(counters.conn.client.hget(counters.conn.keys.metrics(), name) or 0)


def test_counts_are_held_then_written_together_by_the_writer(store) -> None:
    counters = store(0.3)
    counters.add({"job:ready:audio": 2, "job:failed:audio": 0})
    counters.add({"job:ready:audio": 1})
    counters.observe("gate_pass_seconds", 0.004)
    assert field(counters, "job:ready:audio") == 0  # held: no round trip per count
    wait_for(lambda: field(counters, "job:ready:audio") == 3, 5, "the writer's flush")
    assert field(counters, histogram_field("gate_pass_seconds", "le=0.005")) == 1
    assert field(counters, histogram_field("gate_pass_seconds", "sum_us")) == 4000
    assert counters.conn.client.hget(counters.conn.keys.metrics(), histogram_field("gate_pass_seconds", "last"))
    assert not counters.conn.client.hexists(counters.conn.keys.metrics(), "job:failed:audio")


def test_a_read_includes_what_the_process_holds_and_close_writes_the_rest(store) -> None:
    counters = store(60)
    counters.add({"dispatch:dispatched": 4})
    assert counters.read()["dispatch:dispatched"] == "4"
    counters.add({"dispatch:dispatched": 1})
    counters.close()
    assert field(counters, "dispatch:dispatched") == 5


def test_counts_made_while_redis_is_down_are_written_once_it_answers(store) -> None:
    counters = store(60)
    reachable = counters.conn.client
    counters.conn.client = redis.Redis(port=free_port(), socket_connect_timeout=0.5)  # nothing listens there
    try:
        counters.add({"job:started:audio": 2})
        counters.flush()  # refused: kept
        counters.add({"job:started:audio": 1})
    finally:
        counters.conn.client = reachable
    counters.flush()
    assert field(counters, "job:started:audio") == 3
    counters.close()


def test_a_flush_applied_whose_reply_was_lost_is_not_added_again(store, monkeypatch) -> None:
    """Redis applied a flush but its reply never came back (a timeout): sent again, it must change nothing."""
    counters = store(60)
    counters.add({"job:ready:audio": 1})
    counters.flush()  # goes through (and leaves on the server whatever a flush needs loaded there)
    read_response = redis.connection.Connection.read_response
    lost: list[bool] = []

    def lose_one_reply(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        reply = read_response(self, *args, **kwargs)  # Redis has answered: what was sent is applied
        if not lost:
            lost.append(True)
            raise redis.TimeoutError("Timeout reading from socket")
        return reply

    counters.add({"job:ready:audio": 2})
    counters.observe("gate_pass_seconds", 0.004)
    with monkeypatch.context() as patch:
        patch.setattr(redis.connection.Connection, "read_response", lose_one_reply)
        counters.flush()  # applied, but the process cannot know it
    assert lost
    counters.add({"job:ready:audio": 4})
    counters.flush()
    assert field(counters, "job:ready:audio") == 7
    assert field(counters, histogram_field("gate_pass_seconds", "count")) == 1
    assert field(counters, histogram_field("gate_pass_seconds", "le=0.005")) == 1
    counters.close()


def test_a_forked_child_writes_only_its_own_counts(store) -> None:
    counters = store(60)
    counters.add({"job:ready:image": 5})  # held by the parent when it forks
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's exit status says how it went
        try:
            counters.add({"job:ready:image": 1})
            counters.flush()
        finally:
            os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    assert field(counters, "job:ready:image") == 1  # the child's one count, not the parent's five again
    counters.close()
    assert field(counters, "job:ready:image") == 6


def test_counts_from_many_threads_at_once_are_all_written(store) -> None:
    counters = store(0.05)  # the writer flushes while the threads count
    start = threading.Barrier(8)

    def count() -> None:
        start.wait()  # every thread's first update at the same moment (the writer starts on the first)
        for _ in range(500):
            counters.add({"job:started:audio": 1})
            counters.observe("gate_pass_seconds", 0.001)

    threads = [threading.Thread(target=count) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counters.close()
    assert field(counters, "job:started:audio") == 4000
    assert field(counters, histogram_field("gate_pass_seconds", "count")) == 4000
