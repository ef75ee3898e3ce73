"""Shared builders for integration tests (real Postgres, Redis and broker)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import redis

from animastor_tasks.adapters.artifacts import LocalArtifactStore
from animastor_tasks.config import Settings
from animastor_tasks.domain.book import Book, parse_book
from animastor_tasks.flow.generate import run_job
from animastor_tasks.flow.job import Job, Later
from animastor_tasks.generators import EntryPointGenerators
from animastor_tasks.worker.wiring import Wiring


class Pauses(Later):
    """The pauses a host's jobs ask of its process (its runs keep failing: `flow.host_health.pause_if_sick`), recorded
    rather than waited out: a test's own loop is the worker here; worker/chain.py's wait is test_chain_shutdown.py's."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self.ended_by: list[Callable[[], bool] | None] = []

    def pause(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        self.asked.append(seconds)
        self.ended_by.append(until)


def make_book(book_id: str = "b1", chapters: int = 2, scenes: int = 3, text: str = "Once upon a time") -> Book:
    return parse_book(
        {
            "book_id": book_id,
            "title": f"Book {book_id}",
            "chapters": [
                {
                    "chapter_id": f"ch{c}",
                    "title": f"Chapter {c}",
                    "scenes": [
                        {"scene_id": f"s{s}", "text": f"{text} {c}.{s}", "prompt": f"a lighthouse {c}.{s}"}
                        for s in range(1, scenes + 1)
                    ],
                }
                for c in range(1, chapters + 1)
            ],
        }
    )


def advertise(rt: Wiring, *queues: str, host: str = "test-worker@local", ttl: float = 60.0) -> None:
    """Announce a consumer the way a worker's heartbeat does (for tests without GPU workers)."""
    rt.presence.heartbeat(host, queues, ttl)


def lose_leases(rt: Wiring, pairs: list[tuple[str, str, str, str]]) -> None:
    """The pairs' leases gone, whoever held them (expired, or lost with Redis's data)."""
    rt.redis.client.delete(*(rt.redis.keys.lease(*pair) for pair in pairs))


def queued_messages(rt: Wiring, queue: str) -> int:
    """Messages waiting in a queue of the real Redis broker."""
    client = redis.Redis.from_url(rt.settings.broker_url)
    try:
        return int(client.llen(queue))
    finally:
        client.close()


def states(rt: Wiring, book: str) -> dict[tuple[str, str, str], str]:
    return {(c, s, st): state for c, s, st, state, _ in rt.ports.assets.scene_states(book)}


def fake_artifact(sha: str) -> dict[str, Any]:
    """An artifact record for a simulated completion (no generator involved)."""
    return {
        "sha256": sha.ljust(64, "0"),
        "size": 1,
        "media_type": "audio/wav",
        "generator": "sim",
        "duration_ms": 1,
        "path": "-",
    }


def use_settings(rt: Wiring, settings: Settings) -> None:
    """Point the flows at changed settings; the adapters built from settings follow."""
    rt.catalog.registry = settings.registry
    rt.ports = replace(
        rt.ports,
        settings=settings,
        artifacts=LocalArtifactStore(settings.artifact_root),
        generators=EntryPointGenerators(settings),
    )


class CountingBroker:
    """A `QueueProbe` like RabbitMQ's: it cannot list the waiting jobs, only count them per queue."""

    def __init__(self, depths: dict[str, int]) -> None:
        self.depths = depths

    def queued_dispatch_ids(self, queues: Collection[str]) -> set[str] | None:
        return None

    def queue_depths(self, queues: Collection[str]) -> dict[str, int] | None:
        return {q: self.depths.get(q, 0) for q in queues}

    def waiting(self, queue: str) -> int | None:
        return self.depths.get(queue, 0)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The operator CLI as a subprocess, in this test run's environment."""
    return subprocess.run(
        [sys.executable, "-m", "animastor_tasks.operator.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
    )


def read_calls(rt: Wiring, *names: str) -> list[tuple[Any, ...]]:
    """Every call from now on of the reads `rt.ports.assets.<name>` named, with its arguments (the real read
    still runs): which of a book's reads a flow made."""
    calls: list[tuple[Any, ...]] = []
    for name in names:
        real = getattr(rt.ports.assets, name)
        setattr(rt.ports.assets, name, lambda *a, _real=real, **k: calls.append((*a, *k.values())) or _real(*a, **k))
    return calls


def ended_unseen(rt: Wiring, book: str) -> str:
    """One running job of `book` (the first by scene id) ended, its pair ready, with nothing else told (no refill,
    no hand-over): its dispatch id."""
    with rt.db.transaction() as conn:
        row = conn.execute(
            "UPDATE asset_states SET state = 'ready' WHERE (book_id, chapter_id, scene_id, stage) = (SELECT book_id,"
            " chapter_id, scene_id, stage FROM asset_states WHERE book_id = %s AND state = 'generating'"
            " ORDER BY scene_id LIMIT 1) RETURNING dispatch_id",
            (book,),
        ).fetchone()
    assert row is not None, f"no job of {book!r} running"
    return str(row[0])


def end_job(rt: Wiring, book: str, scene: str, stage: str = "audio") -> None:
    """The running job of the pair (chapter ch1) runs to its end, ready, in this process, as its GPU worker's would:
    the control messages it sends stay queued."""
    with rt.db.transaction() as conn:
        dispatch_id, token = conn.execute(
            "SELECT dispatch_id, fencing_token FROM asset_states"
            " WHERE (book_id, chapter_id, scene_id, stage) = (%s, 'ch1', %s, %s) AND state = 'generating'",
            (book, scene, stage),
        ).fetchone()
    assert run_job(rt.ports, Job(book, "ch1", scene, stage, dispatch_id, token), worker="t@h")["outcome"] == "ready"
