"""Celery processes on the hosts of a `Network`, and the per-test view of the whole cluster.

`HostCluster` is the tests' `Cluster` with every process started inside one host's namespace and working
directory (GPU hosts share no directory: each has its own, and artifacts go to the control host's S3
server). `ManyHosts` is one test's cluster: a `Stack` in the test's own namespace (the observer) reading
the control host's Postgres and Redis, one `HostCluster` per host, and the figures the test reports.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from animastor_tasks.adapters.redis.presence import PresenceStore
from tests.support.cluster import REPO_ROOT, Cluster, Proc
from tests.support.netns import Host, Network
from tests.support.netns_services import ControlServices
from tests.support.stack import Stack

FIGURES_FILE = REPO_ROOT / "test-output" / "cluster-figures.jsonl"


class HostCluster(Cluster):
    """Workers and beat of one host: `ip netns exec <ns>` before each command line, the host's own cwd."""

    def __init__(self, host: Host, folder: Path, env: Mapping[str, str], presence: PresenceStore) -> None:
        super().__init__(folder, env, presence)
        self.host = host
        self.workdir = folder / "work"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.supervisor.cwd = self.workdir

    def _spawn(
        self, name: str, role: str, argv: list[str], queues: Sequence[str], env: Mapping[str, str] | None
    ) -> Proc:
        return super()._spawn(name, role, self.host.argv(argv), queues, env)

    def _unique(self, base: str) -> str:
        """`<host>-<base>-<n>-<hex>`: the host's name leads (a restart passes it back in `base`)."""
        return super()._unique(f"{self.host.name}-{base.removeprefix(f'{self.host.name}-')}")


class ManyHosts:
    """One test's cluster: the control host's stores (cleaned for it), its processes on each host."""

    def __init__(
        self,
        network: Network,
        services: ControlServices,
        folder: Path,
        env: Mapping[str, str],
        *,
        broker: str,
        test: str,
    ) -> None:
        self.network, self.services, self.folder = network, services, folder
        self.broker, self.test = broker, test
        self.env = dict(env)
        self.stack = Stack({**self.env, "ANIMASTOR_ARTIFACT_ROOT": str(folder / "observer-artifacts")}, folder)
        self.hosts: dict[str, HostCluster] = {}
        self.figures: dict[str, Any] = {}

    @property
    def settings(self) -> Any:
        return self.stack.settings

    def host(self, name: str) -> HostCluster:
        """The processes of host `name` (created on first use); a GPU host keeps its artifacts apart."""
        if name not in self.hosts:
            host = self.network.hosts[name]
            folder = self.folder / name
            env = {"ANIMASTOR_ARTIFACT_ROOT": str(folder / "work" / "artifacts")}
            self.hosts[name] = HostCluster(host, folder, {**self.env, **env}, self.stack.rt.presence)
        return self.hosts[name]

    # -- faults --------------------------------------------------------------------------------------------
    def partition(self, name: str) -> float:
        self.network.partition(self.network.hosts[name])
        return time.monotonic()

    def heal(self, name: str) -> float:
        self.network.heal(self.network.hosts[name])
        return time.monotonic()

    def lose(self, name: str) -> float:
        self.network.lose(self.network.hosts[name])
        return time.monotonic()

    # -- reads ---------------------------------------------------------------------------------------------
    def live(self, proc: Proc) -> bool:
        """Whether the worker's heartbeat is live in the control host's presence store."""
        return self.host(proc.name.split("-", 1)[0]).advertised(proc) is not None

    def check_artifacts(self, book: str, pairs: set[tuple[str, str, str]]) -> list[dict[str, Any]]:
        """One artifact row and one job.ready per pair, under the pair's current token; the stored bytes (S3
        object, or the file on the GPU host that wrote it) match the recorded size and sha256."""
        assets = self.stack.asset_rows(book)
        rows = self.stack.query(
            "SELECT chapter_id, scene_id, stage, fencing_token, dispatch_id, sha256, size_bytes, path, uri"
            " FROM artifacts WHERE book_id = %s ORDER BY id",
            (book,),
        )
        per_pair: dict[tuple[str, str, str], list[tuple[Any, ...]]] = {}
        for row in rows:
            per_pair.setdefault((row[0], row[1], row[2]), []).append(row)
        assert set(per_pair) == pairs, f"artifacts for {sorted(set(per_pair) ^ pairs)} unexpected or missing"
        for pair, found in per_pair.items():
            assert len(found) == 1, f"{pair}: {len(found)} artifact rows {found}"
            _, _, _, token, dispatch_id, sha, size, path, uri = found[0]
            asset = assets[pair]
            assert (asset["state"], asset["token"], asset["dispatch_id"]) == ("ready", token, dispatch_id), (
                pair,
                asset,
            )
            assert self._stored(uri, path) == (size, sha), f"{pair}: stored bytes of {uri or path} do not match"
        ready = [e for e in self.stack.events("job.ready", book)]
        assert len(ready) == len(pairs), f"{len(ready)} job.ready events for {len(pairs)} pairs"
        return [dict(zip(("chapter", "scene", "stage", "token", "dispatch_id"), r[:5], strict=True)) for r in rows]

    def _stored(self, uri: str | None, path: str) -> tuple[int, str]:
        if uri and uri.startswith("s3://"):
            assert self.services.s3_server is not None
            parts = urlsplit(uri)
            body = self.services.s3_server.client().get_object(Bucket=parts.netloc, Key=parts.path.lstrip("/"))
            data = body["Body"].read()
        else:
            data = Path(path).read_bytes()
        return len(data), hashlib.sha256(data).hexdigest()

    def starts(self, book: str, after: Any = None) -> list[dict[str, Any]]:
        return [e for e in self.stack.events("job.started", book) if after is None or e["at"] > after]

    # -- figures -------------------------------------------------------------------------------------------
    def report(self, **figures: Any) -> None:
        """Record figures: printed, and appended as one JSON line to test-output/cluster-figures.jsonl."""
        self.figures.update(figures)
        line = {"test": self.test, "broker": self.broker, "artifacts": self.artifact_store(), **self.figures}
        print("cluster figures:", json.dumps(line, default=str))
        FIGURES_FILE.parent.mkdir(parents=True, exist_ok=True)
        with FIGURES_FILE.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line, default=str) + "\n")

    def artifact_store(self) -> str:
        return "s3" if self.env.get("ANIMASTOR_ARTIFACT_URL", "").startswith("s3://") else "per-host directory"

    def diagnostics(self, lines: int = 60) -> str:
        return "\n".join(f"===== host {name}\n{c.report(lines=lines)}" for name, c in self.hosts.items())

    # -- teardown ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Heal every link, stop every process of every host, then the observer's stack; checks survivors."""
        self.network.heal_all()
        for cluster in self.hosts.values():  # a cold shutdown of every process at once: nothing to finish now
            for child in cluster.supervisor.children.values():
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGQUIT)
        try:
            for cluster in reversed(list(self.hosts.values())):
                cluster.close()
        finally:
            self.stack.close()
        left = {name: c.supervisor.survivors() for name, c in self.hosts.items() if c.supervisor.survivors()}
        assert not left, f"processes survived the cluster: {left}"
