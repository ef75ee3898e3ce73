"""Operator-facing tests (Flower, metrics, compose) and the helpers they share with the demo test (tests/dev).

Every stack of real processes here runs against stores of its own: a private redis-server on
a free port (broker and coordination; another test run's workers never see our queues, and
the shared test Redis db that other runs flush is left alone) and a fresh Postgres database
on the configured server, dropped afterwards. Processes are started with the demo's own
`Supervisor` (through `tests.support.stack.Stack`), so the same code that the demo relies on
to leave nothing behind is what these tests check.
"""

from __future__ import annotations

import contextlib
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from animastor_tasks.dev.probes import drop_database, ensure_database, with_database
from tests.support.private_redis import PrivateRedis

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
def operator_env(folder: Path, **extra: str) -> Iterator[dict[str, str]]:
    """The environment of one stack: private Redis, a database of its own (migrated), a key prefix.

    The database lives on the server `tests/conftest.py` configured (a local embedded one on a
    fresh machine) and is dropped on exit.
    """
    from animastor_tasks.adapters.postgres.migrations import migrate
    from animastor_tasks.adapters.postgres.pool import Database

    with PrivateRedis(folder / "redis") as server:
        redis_url = server.url
        env = dict(os.environ)
        env.update(
            ANIMASTOR_REDIS_URL=redis_url,
            ANIMASTOR_BROKER_URL=redis_url,
            ANIMASTOR_KEY_PREFIX=f"op{uuid.uuid4().hex[:8]}",
            ANIMASTOR_DATABASE_URL=with_database(
                os.environ["ANIMASTOR_DATABASE_URL"], f"animastor_op_{uuid.uuid4().hex[:10]}"
            ),
            ANIMASTOR_ARTIFACT_ROOT=str(folder / "artifacts"),
            ANIMASTOR_STAGES=FAST_STAGES,
            ANIMASTOR_PRESENCE_TTL_SECONDS="3",
        )
        for key in ("ANIMASTOR_FLOWER_BASIC_AUTH", "ANIMASTOR_FLOWER_DEV_NO_AUTH", "FLOWER_BASIC_AUTH"):
            env.pop(key, None)
        env.update(extra)
        ensure_database(env["ANIMASTOR_DATABASE_URL"])
        db = Database(env["ANIMASTOR_DATABASE_URL"])
        try:
            migrate(db)
        finally:
            db.close()
        try:
            yield env
        finally:
            drop_database(env["ANIMASTOR_DATABASE_URL"])


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
