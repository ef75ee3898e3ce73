"""Operator-facing tests (demo, Flower, metrics, compose) and the helpers they share.

Every stack of real processes here runs against stores of its own: a private redis-server on
a free port (broker and coordination; another test run's workers never see our queues, and
the shared test Redis db that other runs flush is left alone) and a fresh Postgres database
on the configured server, dropped afterwards. Processes are started with the demo's own
`Supervisor`, so the same code that the demo relies on to leave nothing behind is what
these tests check.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import redis

from animastor_tasks.dev import stores as devstack
from animastor_tasks.dev.demo import Supervisor, celery_argv, free_port, group_members, marked_processes, worker_argv
from tests.support import redis_server_executable, wait_for

#: The builtin generator with no sleeping: jobs take milliseconds.
FAST_STAGES = (
    '{"audio": {"queue": "gpu.audio", "input": "text", "media_type": "audio/wav"},'
    ' "image": {"queue": "gpu.image", "input": "prompt", "media_type": "image/png"}}'
)


def make_book(book_id: str, scenes: int = 3) -> Any:
    """A one-chapter book with `scenes` scenes."""
    from animastor_tasks.domain.book import parse_book

    return parse_book(
        {
            "book_id": book_id,
            "title": f"Book {book_id}",
            "chapters": [
                {
                    "chapter_id": "ch1",
                    "title": "Chapter 1",
                    "scenes": [
                        {"scene_id": f"s{n}", "text": f"Scene {n} of {book_id}.", "prompt": f"a lighthouse, view {n}"}
                        for n in range(1, scenes + 1)
                    ],
                }
            ],
        }
    )


@contextlib.contextmanager
def private_redis(folder: Path) -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; its URL."""
    folder.mkdir(parents=True, exist_ok=True)
    executable = redis_server_executable()
    for _ in range(5):
        port = free_port()
        with open(folder / "redis.log", "ab") as log:
            proc = subprocess.Popen(
                [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                cwd=folder,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
        try:
            wait_for(lambda: _pings(client) or proc.poll() is not None, 10, "redis-server up")  # noqa: B023
        finally:
            client.close()
        if proc.poll() is None:
            break
    else:
        raise AssertionError(f"could not start a private redis-server:\n{(folder / 'redis.log').read_text()}")
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@contextlib.contextmanager
def operator_env(folder: Path, **extra: str) -> Iterator[dict[str, str]]:
    """The environment of one stack: private Redis, a database of its own (migrated), a key prefix.

    The database lives on the server `tests/conftest.py` configured (a local embedded one on a
    fresh machine) and is dropped on exit.
    """
    from animastor_tasks.adapters.postgres.pool import Database, migrate

    with private_redis(folder / "redis") as redis_url:
        env = dict(os.environ)
        env.update(
            ANIMASTOR_REDIS_URL=redis_url,
            ANIMASTOR_BROKER_URL=redis_url,
            ANIMASTOR_KEY_PREFIX=f"op{uuid.uuid4().hex[:8]}",
            ANIMASTOR_DATABASE_URL=devstack.with_database(
                os.environ["ANIMASTOR_DATABASE_URL"], f"animastor_op_{uuid.uuid4().hex[:10]}"
            ),
            ANIMASTOR_ARTIFACT_ROOT=str(folder / "artifacts"),
            ANIMASTOR_STAGES=FAST_STAGES,
            ANIMASTOR_PRESENCE_TTL_SECONDS="3",
        )
        for key in ("ANIMASTOR_FLOWER_BASIC_AUTH", "ANIMASTOR_FLOWER_DEV_NO_AUTH", "FLOWER_BASIC_AUTH"):
            env.pop(key, None)
        env.update(extra)
        devstack.ensure_database(env["ANIMASTOR_DATABASE_URL"])
        db = Database(env["ANIMASTOR_DATABASE_URL"])
        try:
            migrate(db)
        finally:
            db.close()
        try:
            yield env
        finally:
            devstack.drop_database(env["ANIMASTOR_DATABASE_URL"])


class Stack:
    """Real Celery processes for one test, run by the demo's `Supervisor`."""

    def __init__(self, env: Mapping[str, str], folder: Path) -> None:
        from animastor_tasks.config import Settings
        from animastor_tasks.flow.runtime import Runtime

        self.env = dict(env)
        self.folder = folder
        self.supervisor = Supervisor(self.env, folder / "logs", say=lambda _: None)
        self.settings = Settings.from_env(self.env)
        self.rt = Runtime.build(self.settings)

    def start_control(self) -> None:
        from animastor_tasks.worker.celery_config import CONTROL_QUEUE

        self.supervisor.start("control", worker_argv(CONTROL_QUEUE, "control@%h", concurrency=2))

    def start_gpu(self, stage: str) -> None:
        self.supervisor.start(stage, worker_argv(self.settings.registry.get(stage).queue, f"{stage}@%h"))

    def start_beat(self) -> None:
        self.supervisor.start("beat", celery_argv("beat", "-l", "INFO", "-s", str(self.folder / "beat-schedule")))

    def start_flower(self, port: int, env: Mapping[str, str]) -> None:
        conf = Path(__file__).resolve().parents[2] / "flowerconfig.py"
        flower_env = {**env, "ANIMASTOR_FLOWER_PORT": str(port)}
        self.supervisor.start("flower", celery_argv("flower", f"--conf={conf}"), env=flower_env)

    def wait_consumers(self, *queues: str, timeout: float = 60) -> None:
        def ready() -> bool:
            self.supervisor.check(*self.supervisor.children)
            live = self.rt.coord.live_consumers(list(queues))
            return all(live.get(q) for q in queues)

        wait_for(ready, timeout, f"live consumers on {', '.join(queues)}")

    def log_text(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted((self.folder / "logs").glob("*.log"))
        )

    def close(self) -> None:
        """Stop every process and fail when any of them survived."""
        self.supervisor.stop_all(grace=15)
        self.rt.close()
        left = self.supervisor.survivors()
        assert not left, f"processes survived the stack: {left}"


def http_get(url: str, auth: tuple[str, str] | None = None, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; an HTTP error status is returned, not raised, and 0 when nothing answers."""
    request = urllib.request.Request(url)
    if auth is not None:
        import base64

        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode(errors="replace")
    except OSError as err:  # nothing listens (yet): status 0
        return 0, str(err)


def leftovers(token: str, groups: Sequence[int]) -> list[int]:
    """Live processes carrying a supervisor token or belonging to one of `groups`."""
    found = set(marked_processes(token))
    for pgid in groups:
        found.update(group_members(pgid))
    return sorted(found)


def groups_in(output: str) -> list[int]:
    """Process groups the demo announced (`... (process group N) ...`)."""
    return [int(n) for n in re.findall(r"process group (\d+)", output)]
