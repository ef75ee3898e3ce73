"""The stack a test works with: real Celery processes, the runtime that observes them, the public client.

Why one class for every suite: the e2e and fault tests, the Flower, metrics and demo tests all need the
same thing, processes on stores of their own that never outlive the test, and the same reads of what
those processes did.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from animastor_tasks.client import Client
from animastor_tasks.config import Settings
from animastor_tasks.dev.celery_commands import celery_argv, worker_argv
from animastor_tasks.dev.demo_stack import flower_config_path
from animastor_tasks.domain.registry import CONTROL_QUEUE
from tests.support import wait_for
from tests.support.cluster import Cluster


class Stack:
    """One test's processes on the stores named in `env`, with their files under `folder`.

    `cluster` starts uniquely named workers and beat, for tests that kill, stop and restart them. The
    `start_*` methods start processes under plain names (`control`, `<stage>`, `beat`, `flower`), the
    way `animastor-tasks demo` does, with task events on (Flower and the metrics exporter read them);
    `supervisor` starts anything else. `close` stops all of them and fails when one survived.
    """

    def __init__(self, env: Mapping[str, str], folder: Path) -> None:
        from animastor_tasks.worker.wiring import build

        self.env = dict(env)
        self.folder = folder
        self.settings = Settings.from_env(self.env)
        self.rt = build(self.settings)
        self.client = Client(self.settings, timeout=30)
        self.cluster = Cluster(folder, self.env, self.rt.presence)
        self.supervisor = self.cluster.supervisor
        self.artifact_root = Path(self.env["ANIMASTOR_ARTIFACT_ROOT"])

    def close(self) -> None:
        """Stop every process, then fail when any of them survived."""
        try:
            self.cluster.close()
        finally:
            self.client.close()
            self.rt.close()
        left = self.supervisor.survivors()
        assert not left, f"processes survived the stack: {left}"

    # -- processes under plain names ------------------------------------------------------------------------
    def start_control(self) -> None:
        self.supervisor.start("control", worker_argv(CONTROL_QUEUE, "control@%h", concurrency=2))

    def start_gpu(self, stage: str) -> None:
        self.supervisor.start(stage, worker_argv(self.settings.registry.get(stage).queue, f"{stage}@%h"))

    def start_beat(self) -> None:
        self.supervisor.start("beat", celery_argv("beat", "-l", "INFO", "-s", str(self.folder / "beat-schedule")))

    def start_flower(self, port: int, env: Mapping[str, str]) -> None:
        flower_env = {**env, "ANIMASTOR_FLOWER_PORT": str(port)}
        self.supervisor.start("flower", celery_argv("flower", f"--conf={flower_config_path()}"), env=flower_env)

    def wait_consumers(self, *queues: str, timeout: float = 60) -> None:
        def ready() -> bool:
            self.supervisor.check()
            live = self.rt.presence.live_consumers(list(queues))
            return all(live.get(q) for q in queues)

        wait_for(ready, timeout, f"live consumers on {', '.join(queues)}")

    def log_text(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(self.supervisor.log_dir.glob("*.log"))
        )

    # -- reads from Postgres --------------------------------------------------------------------------------
    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self.rt.db.transaction() as conn:
            return [tuple(r) for r in conn.execute(sql, params).fetchall()]

    def db_now(self) -> Any:
        return self.query("SELECT now()")[0][0]

    def states(self, book: str) -> dict[tuple[str, str, str], str]:
        return {(c, s, st): state for c, s, st, state, _ in self.rt.ports.assets.scene_states(book)}

    def commands(self, book: str) -> dict[str, Any]:
        """{stage: newest command row} for the book."""
        newest: dict[str, Any] = {}
        for row in sorted(self.rt.ports.commands.commands(book=book), key=lambda r: r.created_at):
            newest[row.stage] = row
        return newest

    def wait_commands(self, book: str, stages: Sequence[str], status: str, timeout: float) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            rows = self.commands(book)
            if all(s in rows and rows[s].status == status for s in stages):
                return rows
            return None

        try:
            return wait_for(done, timeout, interval=0.1, what=f"commands {list(stages)} {status}")
        except AssertionError as err:
            rows = {s: (r.status, r.reason, r.progress) for s, r in self.commands(book).items()}
            raise AssertionError(f"{err}; commands now: {rows}\n{self.cluster.report()}") from None

    def artifacts(self, book: str) -> list[dict[str, Any]]:
        cols = ("chapter_id", "scene_id", "stage", "fencing_token", "dispatch_id", "sha256", "size_bytes", "path")
        rows = self.query(f"SELECT {', '.join(cols)} FROM artifacts WHERE book_id = %s ORDER BY id", (book,))
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def events(self, kind: str, book: str | None = None) -> list[dict[str, Any]]:
        cols = ("at", "chapter_id", "scene_id", "stage", "dispatch_id", "detail")
        where, params = "kind = %s", [kind]
        if book is not None:
            where += " AND book_id = %s"
            params.append(book)
        rows = self.query(f"SELECT {', '.join(cols)} FROM events WHERE {where} ORDER BY id", params)
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def asset_rows(self, book: str) -> dict[tuple[str, str, str], dict[str, Any]]:
        rows = self.query(
            "SELECT chapter_id, scene_id, stage, state, fencing_token, dispatch_id, artifact_sha256"
            " FROM asset_states WHERE book_id = %s",
            (book,),
        )
        return {
            (c, s, st): {"state": state, "token": token, "dispatch_id": d, "sha256": sha}
            for c, s, st, state, token, d, sha in rows
        }

    def check_artifacts(self, book: str, pairs: Iterable[tuple[str, str, str]]) -> list[dict[str, Any]]:
        """Exactly one artifact row per pair, made under the pair's current token; files exist, sha256 match."""
        wanted = set(pairs)
        assets = self.asset_rows(book)
        rows = self.artifacts(book)
        per_pair: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        for row in rows:
            per_pair.setdefault((row["chapter_id"], row["scene_id"], row["stage"]), []).append(row)
        assert set(per_pair) == wanted, f"artifacts for {sorted(set(per_pair) ^ wanted)} unexpected or missing"
        for pair, found in per_pair.items():
            assert len(found) == 1, f"{pair}: {len(found)} artifact rows {found}"
            row, asset = found[0], assets[pair]
            assert asset["state"] == "ready", f"{pair} is {asset['state']}"
            assert row["fencing_token"] == asset["token"], f"{pair}: artifact token {row['fencing_token']} != {asset}"
            assert row["dispatch_id"] == asset["dispatch_id"], f"{pair}: artifact dispatch != state {asset}"
            assert row["sha256"] == asset["sha256"], f"{pair}: artifact sha != state sha"
            path = Path(row["path"])
            assert path.is_file(), f"{pair}: artifact file {path} missing"
            assert self.artifact_root in path.parents, f"{path} outside {self.artifact_root}"
            data = path.read_bytes()
            assert hashlib.sha256(data).hexdigest() == row["sha256"], f"{pair}: {path} content does not match sha256"
            assert len(data) == row["size_bytes"]
        return rows
