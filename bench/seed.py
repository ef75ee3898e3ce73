"""Bulk loading for the benchmarks: books, scenes, commands and Redis state by COPY and pipelines."""

from __future__ import annotations

import io
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import STAGES, pg_connect

StateOf = Callable[[str, int, str], str]


def scene_key(index: int, scenes_per_chapter: int) -> tuple[str, str]:
    """(chapter, scene) of the index-th scene of a book, in reading order."""
    return f"ch{index // scenes_per_chapter:05d}", f"sc{index:07d}"


@dataclass(frozen=True)
class BookShape:
    book_id: str
    scenes: int
    scenes_per_chapter: int = 500

    def keys(self) -> list[tuple[str, str]]:
        return [scene_key(i, self.scenes_per_chapter) for i in range(self.scenes)]


def _copy(cur: Any, table: str, columns: Sequence[str], lines: Iterable[str], chunk: int = 20_000) -> int:
    count = 0
    with cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        buf = io.StringIO()
        pending = 0
        for line in lines:
            buf.write(line)
            pending += 1
            if pending >= chunk:
                copy.write(buf.getvalue())
                buf = io.StringIO()
                count += pending
                pending = 0
        if pending:
            copy.write(buf.getvalue())
            count += pending
    return count


def load_books(
    shapes: Sequence[BookShape],
    state_of: StateOf,
    stages: Sequence[str] = STAGES,
    *,
    layer_config: str | None = None,
) -> dict[str, int]:
    """COPY books, chapters, scenes and one asset row per scene x stage; FK triggers off while loading.

    `state_of(book, scene_index, stage)` gives each pair's state; `generating` rows get a
    dispatch id and token 1, `ready` rows an input hash and artifact digest.
    """
    counts = {"books": 0, "chapters": 0, "scenes": 0, "asset_states": 0}
    layers = "\\N" if layer_config is None else layer_config
    with pg_connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("SET LOCAL session_replication_role = replica")
        counts["books"] = _copy(
            cur,
            "books",
            ("book_id", "title", "layer_config"),
            (f"{s.book_id}\t{s.book_id}\t{layers}\n" for s in shapes),
        )

        def chapters() -> Iterator[str]:
            for s in shapes:
                n = (s.scenes + s.scenes_per_chapter - 1) // s.scenes_per_chapter
                for c in range(n):
                    yield f"{s.book_id}\tch{c:05d}\t{c}\n"

        counts["chapters"] = _copy(cur, "chapters", ("book_id", "chapter_id", "position"), chapters())

        def scenes() -> Iterator[str]:
            for s in shapes:
                for i in range(s.scenes):
                    chapter, scene = scene_key(i, s.scenes_per_chapter)
                    yield f"{s.book_id}\t{chapter}\t{scene}\t{i}\tscene {i} text\tscene {i} prompt\t{{}}\n"

        counts["scenes"] = _copy(
            cur, "scenes", ("book_id", "chapter_id", "scene_id", "position", "text", "prompt", "input_hashes"), scenes()
        )

        def assets() -> Iterator[str]:
            for s in shapes:
                for i in range(s.scenes):
                    chapter, scene = scene_key(i, s.scenes_per_chapter)
                    for stage in stages:
                        state = state_of(s.book_id, i, stage)
                        if state == "generating":
                            extra = f"1\t{uuid.uuid4().hex}\t\\N\t\\N"
                        elif state == "ready":
                            extra = "0\t\\N\th0\ta0"
                        else:
                            extra = "0\t\\N\t\\N\t\\N"
                        yield f"{s.book_id}\t{chapter}\t{scene}\t{stage}\t{i}\t{state}\t{extra}\n"

        counts["asset_states"] = _copy(
            cur,
            "asset_states",
            (
                "book_id",
                "chapter_id",
                "scene_id",
                "stage",
                "position",
                "state",
                "fencing_token",
                "dispatch_id",
                "input_hash",
                "artifact_sha256",
            ),
            assets(),
        )
        conn.commit()
    return counts


def add_command(book: str, stage: str, scenes: Sequence[tuple[str, str]], status: str = "active") -> str:
    """One command (COPY of its targets) covering `scenes` for `stage`; returns its id."""
    command_id = str(uuid.uuid4())
    with pg_connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute(
            "INSERT INTO commands (command_id, book_id, stage, status, force, request_id, target_count)"
            " VALUES (%s, %s, %s, %s, true, %s, %s)",
            (command_id, book, stage, status, str(uuid.uuid4()), len(scenes)),
        )
        cur.execute("SET LOCAL session_replication_role = replica")
        _copy(
            cur,
            "command_targets",
            ("command_id", "book_id", "chapter_id", "scene_id", "stage"),
            (f"{command_id}\t{book}\t{c}\t{s}\t{stage}\n" for c, s in scenes),
        )
        conn.commit()
    return command_id


def add_commands_bulk(shapes: Sequence[BookShape], stages: Sequence[str] = STAGES) -> int:
    """One active command per book and stage covering every scene, for many books in two COPYs."""
    ids = {(s.book_id, stage): str(uuid.uuid4()) for s in shapes for stage in stages}
    sizes = {s.book_id: s.scenes for s in shapes}
    with pg_connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("SET LOCAL session_replication_role = replica")
        _copy(
            cur,
            "commands",
            ("command_id", "book_id", "stage", "status", "force", "request_id", "target_count"),
            (
                f"{cid}\t{book}\t{stage}\tactive\tt\t{uuid.uuid4()}\t{sizes[book]}\n"
                for (book, stage), cid in ids.items()
            ),
        )

        def targets() -> Iterator[str]:
            for s in shapes:
                scenes = s.keys()
                for stage in stages:
                    cid = ids[(s.book_id, stage)]
                    for c, sc in scenes:
                        yield f"{cid}\t{s.book_id}\t{c}\t{sc}\t{stage}\n"

        count = _copy(cur, "command_targets", ("command_id", "book_id", "chapter_id", "scene_id", "stage"), targets())
        conn.commit()
    return count


def start_work(rt: Any, shapes: Sequence[BookShape], stages: Sequence[str] = STAGES) -> None:
    """What a regenerate of every scene does after its Postgres side, book by book: the Redis side
    (the port it calls), then its gate pass without dispatch (`schedule`)."""
    for s in shapes:
        keys = s.keys()
        for start in range(0, len(keys), 10_000):
            chunk = keys[start : start + 10_000]
            pairs = [(c, sc, stage) for c, sc in chunk for stage in stages]
            rt.ports.book_state.start_work(s.book_id, pairs, chunk, force_ttl=None)
        schedule(rt, s.book_id)


def schedule(rt: Any, book: str) -> None:
    """The gate pass a regenerate runs next, without its dispatch (`dispatch_work=False`, as after a
    layer change): whatever index of books with work the design keeps, the book is in it as a
    regenerate leaves it, and nothing is dispatched while the benchmark sets up."""
    from animastor_tasks.flow.gate import gate_pass

    gate_pass(rt.ports, book, dispatch_work=False)


def add_deferrals(rt: Any, book: str, pairs: Sequence[tuple[str, str, str]], bucket: str, seconds: float) -> None:
    """Deferrals for `pairs` in one bucket, in batches of 10k members."""
    now = time.time()
    for start in range(0, len(pairs), 10_000):
        rt.deferrals.defer(book, bucket, pairs[start : start + 10_000], seconds, now)


def activate(rt: Any, book: str, scenes: Sequence[tuple[str, str]]) -> None:
    for start in range(0, len(scenes), 10_000):
        rt.ports.book_state.activate({book: scenes[start : start + 10_000]})


def advertise_consumers(rt: Any, queues: Sequence[str], ttl: float = 600.0) -> None:
    """A fake live consumer on each queue, so dispatch is not BLOCKED (nothing consumes for real)."""
    rt.presence.heartbeat("bench@host", list(queues), ttl)
