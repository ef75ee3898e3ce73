"""A small process manager for end-to-end tests: real Celery workers and beat as subprocesses.

Every process is started in a session of its own (`start_new_session=True`) so a signal
reaches the whole process group (the worker and its prefork pool children), and
`Cluster.close()` always stops every group it started: SIGCONT (a stopped group cannot
handle SIGTERM), SIGTERM, then SIGKILL after a grace period. An `atexit` hook does the
same for anything a crashed test left behind, so no orphan survives a failing test.

Output of each process goes to its own log file; `Cluster.report()` gives their tails.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from animastor_tasks.adapters.redis.coordination import Coordination
from animastor_tasks.client import Client
from animastor_tasks.config import Settings
from animastor_tasks.flow.runtime import Runtime
from animastor_tasks.worker.celery_config import CONTROL_QUEUE
from tests.support import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
CELERY = [sys.executable, "-m", "celery", "-A", "animastor_tasks"]

_LIVE_GROUPS: set[int] = set()
_LIVE_LOCK = threading.Lock()


def _kill_leftovers() -> None:
    with _LIVE_LOCK:
        groups = list(_LIVE_GROUPS)
    for pgid in groups:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)


atexit.register(_kill_leftovers)


def stage_table(**stages: Mapping[str, Any]) -> str:
    """ANIMASTOR_STAGES JSON; each keyword is a stage with its entry (queue defaults to gpu.<name>)."""
    return json.dumps({name: {"queue": f"gpu.{name}", **entry} for name, entry in stages.items()})


def audio_stage(**entry: Any) -> dict[str, Any]:
    return {"input": "text", "media_type": "audio/wav", "lease_ttl": 4, "params": {"steps": 2}, **entry}


def image_stage(**entry: Any) -> dict[str, Any]:
    return {"input": "prompt", "media_type": "image/png", "lease_ttl": 4, "params": {"steps": 2}, **entry}


@dataclass
class Proc:
    """One started process (a worker, a beat) and its log."""

    name: str
    role: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    queues: tuple[str, ...]
    popen: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)
    hostname: str | None = None  # the worker's node name as it advertises it (name@host)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_log(self, needle: str, timeout: float) -> str:
        def seen() -> bool:
            if needle in self.log():
                return True
            if not self.alive():
                raise AssertionError(f"{self.name} exited ({self.popen.returncode}) before logging {needle!r}")
            return False

        wait_for(seen, timeout, interval=0.05, what=f"{self.name} logs {needle!r}")
        return self.log()


class Cluster:
    """Starts, signals, restarts and always stops worker and beat subprocesses."""

    def __init__(self, workdir: Path, env: Mapping[str, str], coord: Coordination) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env)
        self.coord = coord
        self.procs: list[Proc] = []
        self._seq = 0

    # -- starting ------------------------------------------------------------------------------
    def _unique(self, base: str) -> str:
        self._seq += 1
        return f"{base}-{self._seq}-{uuid.uuid4().hex[:6]}"

    def _spawn(
        self, name: str, role: str, argv: list[str], queues: Sequence[str], env: Mapping[str, str] | None
    ) -> Proc:
        full_env = {**os.environ, **self.env, **(env or {}), "PYTHONUNBUFFERED": "1"}
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "wb") as handle:
            popen = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with _LIVE_LOCK:
            _LIVE_GROUPS.add(popen.pid)
        proc = Proc(name, role, argv, dict(env or {}), log_path, tuple(queues), popen)
        self.procs.append(proc)
        return proc

    def worker(
        self,
        queues: str | Sequence[str],
        *,
        base: str | None = None,
        concurrency: int = 1,
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        timeout: float = 45.0,
        args: Sequence[str] = (),
    ) -> Proc:
        """`args`: extra `celery worker` options (say `--without-mingle`), kept by `restart`."""
        queue_list = [queues] if isinstance(queues, str) else list(queues)
        name = self._unique(base or queue_list[0].replace(".", "-"))
        argv = [
            *CELERY,
            "worker",
            "-Q",
            ",".join(queue_list),
            "-c",
            str(concurrency),
            "--prefetch-multiplier",
            "1",
            "-n",
            f"{name}@%h",
            "-l",
            "info",
            "-P",
            "prefork",
            *args,
        ]
        role = "control" if queue_list == [CONTROL_QUEUE] else "gpu"
        proc = self._spawn(name, role, argv, queue_list, env)
        if wait:
            self.wait_ready(proc, timeout=timeout)
        return proc

    def control(self, *, concurrency: int = 2, **kwargs: Any) -> Proc:
        return self.worker(CONTROL_QUEUE, base="control", concurrency=concurrency, **kwargs)

    def gpu(self, stage: str, **kwargs: Any) -> Proc:
        return self.worker(f"gpu.{stage}", base=stage, **kwargs)

    def beat(self, *, env: Mapping[str, str] | None = None, wait: bool = True, timeout: float = 45.0) -> Proc:
        name = self._unique("beat")
        argv = [
            *CELERY,
            "beat",
            "-s",
            str(self.workdir / f"{name}-schedule"),
            "--pidfile",
            str(self.workdir / f"{name}.pid"),
            "-l",
            "info",
        ]
        proc = self._spawn(name, "beat", argv, (), env)
        if wait:
            self.wait_ready(proc, timeout=timeout)
        return proc

    # -- readiness --------------------------------------------------------------------------------
    def advertised(self, proc: Proc, queue: str | None = None) -> str | None:
        """The worker's hostname if its heartbeat is live under `queue` (default: its first queue)."""
        queue = queue or proc.queues[0]
        live = self.coord.live_consumers([queue]).get(queue, {})
        for host in live:
            if host.startswith(f"{proc.name}@"):
                return host
        return None

    def _ready(self, proc: Proc) -> bool:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited with {proc.popen.returncode} while starting:\n{proc.tail(60)}")
        text = proc.log()
        if proc.role == "beat":
            return "beat: Starting..." in text
        if f"{proc.name}@" not in text or " ready." not in text:
            return False
        if proc.role == "gpu":
            host = self.advertised(proc)
            if host is None:
                return False
            proc.hostname = host
        return True

    def wait_ready(self, *procs: Proc, timeout: float = 45.0) -> None:
        """Wait for several processes at once (they start in parallel)."""
        pending = list(procs)

        def all_ready() -> bool:
            pending[:] = [p for p in pending if not self._ready(p)]
            return not pending

        try:
            wait_for(all_ready, timeout, interval=0.1, what="processes ready")
        except AssertionError as err:
            names = ", ".join(p.name for p in pending)
            raise AssertionError(f"{err}: still starting: {names}\n{self.report(pending)}") from None

    # -- signals ------------------------------------------------------------------------------------
    def send_signal(self, proc: Proc, sig: int, *, group: bool = True) -> None:
        """Send `sig` to the process group (worker + pool children), or only to the main process."""
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)

    def kill(self, proc: Proc, sig: int = signal.SIGKILL, *, group: bool = True) -> None:
        self.send_signal(proc, sig, group=group)
        if sig == signal.SIGKILL:
            proc.popen.wait(timeout=10)
            self._forget(proc)

    def stop(self, proc: Proc, timeout: float = 8.0) -> int | None:
        """SIGTERM to the main process (a clean Celery shutdown), then SIGKILL the group if it lingers."""
        if proc.alive():
            self.send_signal(proc, signal.SIGCONT)
            self.send_signal(proc, signal.SIGTERM, group=False)
            try:
                proc.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(proc, signal.SIGKILL)
                proc.popen.wait(timeout=10)
        # Pool children that outlived their parent: the whole group goes.
        self.send_signal(proc, signal.SIGKILL)
        self._forget(proc)
        return proc.popen.returncode

    def restart(self, proc: Proc, *, wait: bool = True, timeout: float = 45.0) -> Proc:
        """Stop `proc` if it still runs and start the same kind of process under a new unique name."""
        if proc.alive():
            self.stop(proc)
        if proc.role == "beat":
            return self.beat(env=proc.env, wait=wait, timeout=timeout)
        base = proc.name.rsplit("-", 2)[0]
        concurrency = int(proc.argv[proc.argv.index("-c") + 1])
        extra = proc.argv[proc.argv.index("prefork") + 1 :]
        return self.worker(
            list(proc.queues), base=base, concurrency=concurrency, env=proc.env, wait=wait, timeout=timeout, args=extra
        )

    def _forget(self, proc: Proc) -> None:
        with _LIVE_LOCK:
            _LIVE_GROUPS.discard(proc.pid)

    def close(self) -> None:
        """Stop everything this cluster started, whatever state it is in."""
        running = [p for p in self.procs if p.alive()]
        for proc in running:
            self.send_signal(proc, signal.SIGCONT)
            self.send_signal(proc, signal.SIGTERM, group=False)
        deadline = time.monotonic() + 6.0
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            self.send_signal(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
            self._forget(proc)

    # -- one-shot commands ------------------------------------------------------------------------------
    def run(
        self, args: Sequence[str], *, timeout: float = 60.0, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `celery -A animastor_tasks <args>` to completion (its own session, killed on timeout)."""
        full_env = {**os.environ, **self.env, **(env or {}), "PYTHONUNBUFFERED": "1"}
        popen = subprocess.Popen(
            [*CELERY, *args],
            cwd=REPO_ROOT,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        with _LIVE_LOCK:
            _LIVE_GROUPS.add(popen.pid)
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            out, err = popen.communicate()
            raise AssertionError(f"celery {' '.join(args)} did not finish within {timeout}s:\n{out}\n{err}") from None
        finally:
            with _LIVE_LOCK:
                _LIVE_GROUPS.discard(popen.pid)
        return subprocess.CompletedProcess(popen.args, popen.returncode, out, err)

    # -- diagnostics ---------------------------------------------------------------------------------------
    def report(self, procs: Iterable[Proc] | None = None, lines: int = 40) -> str:
        chunks = []
        for proc in procs if procs is not None else self.procs:
            state = "running" if proc.alive() else f"exited {proc.popen.returncode}"
            chunks.append(
                f"----- {proc.name} ({proc.role}, pid {proc.pid}, {state}) {proc.log_path}\n{proc.tail(lines)}"
            )
        return "\n".join(chunks)

    def logs_mentioning(self, needle: str) -> list[tuple[Proc, str]]:
        return [(p, line) for p in self.procs for line in p.log().splitlines() if needle in line]


# ---------------------------------------------------------------------------------------------------------------
# The stack a test works with: env, an observing runtime, the public client and the cluster.


@dataclass
class Stack:
    env: dict[str, str]
    settings: Settings
    rt: Runtime
    client: Client
    cluster: Cluster
    artifact_root: Path

    def close(self) -> None:
        try:
            self.cluster.close()
        finally:
            self.client.close()
            self.rt.close()

    # -- reads from Postgres --------------------------------------------------------------------------------
    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self.rt.db.transaction() as conn:
            return [tuple(r) for r in conn.execute(sql, params).fetchall()]

    def db_now(self) -> Any:
        return self.query("SELECT now()")[0][0]

    def states(self, book: str) -> dict[tuple[str, str, str], str]:
        return {(c, s, st): state for c, s, st, state, _ in self.rt.ledger.scene_states(book)}

    def commands(self, book: str) -> dict[str, Any]:
        """{stage: newest command row} for the book."""
        newest: dict[str, Any] = {}
        for row in sorted(self.rt.ledger.commands(book=book), key=lambda r: r.created_at):
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private redis-server (no persistence) that a test may stop, start again on the same port, or restart.

    Started in a session of its own and remembered in the same leftover set as the cluster's
    processes, so it never outlives the test run. A restart comes back empty, like a real
    Redis restart without persistence.
    """

    def __init__(self, folder: Path, executable: str) -> None:
        self.folder = folder
        self.executable = executable
        self.port = 0
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.folder / "redis.log"

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self, attempts: int = 5) -> str:
        """Start on the port it had (a restart) or, the first time, on a free one; its URL."""
        if self.running():
            return self.url
        for _ in range(attempts if self.port == 0 else 1):
            port = self.port or free_port()
            with open(self.log_path, "ab") as log:
                popen = subprocess.Popen(
                    [self.executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                    cwd=self.folder,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            with _LIVE_LOCK:
                _LIVE_GROUPS.add(popen.pid)
            if self._answers(f"redis://127.0.0.1:{port}/0", popen):
                self.port, self.popen = port, popen
                return self.url
            self._reap(popen)  # the port was taken meanwhile: try another one
        raise AssertionError(f"could not start a private redis-server:\n{self.log_path.read_text()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server (SIGTERM: a clean shutdown; SIGKILL: a crash); the port is kept for `start`."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)
        self._reap(self.popen)
        self.popen = None

    def restart(self) -> str:
        self.stop()
        return self.start()

    @staticmethod
    def _answers(url: str, popen: subprocess.Popen[bytes]) -> bool:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and popen.poll() is None:
                try:
                    return bool(client.ping())
                except redis.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    @staticmethod
    def _reap(popen: subprocess.Popen[bytes]) -> None:
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=5)
        with _LIVE_LOCK:
            _LIVE_GROUPS.discard(popen.pid)


# ---------------------------------------------------------------------------------------------------------------
# Watching the broker and the asset states while a test runs.


class RedisQueueTap:
    """Every push onto a Redis-broker queue, seen through keyspace notifications (our private server).

    Kombu's Redis transport publishes with LPUSH onto a list named after the queue (and
    `<queue>\\x06\\x16<n>` for priorities), so a psubscribe on the keyspace channel sees
    each publish, even one consumed before anyone could look at the list's length.
    """

    def __init__(self, url: str, queues: Sequence[str]) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.client.config_set("notify-keyspace-events", "Kl")
        db = self.client.connection_pool.connection_kwargs.get("db", 0)
        self.queues = list(queues)
        self.pushes: dict[str, int] = dict.fromkeys(self.queues, 0)
        self.push_times: list[tuple[float, str]] = []  # (time.monotonic() when seen, queue) per push
        self.max_len: dict[str, int] = dict.fromkeys(self.queues, 0)
        self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self._prefix = f"__keyspace@{db}__:"
        self._pubsub.psubscribe(*(f"{self._prefix}{q}*" for q in self.queues))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="queue-tap", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.05)
            while message is not None:
                channel = message["channel"].decode("utf-8", "replace")[len(self._prefix) :]
                if message["data"] in (b"lpush", b"rpush"):
                    for queue in self.queues:
                        if channel == queue or channel.startswith(queue + "\x06\x16"):
                            self.pushes[queue] += 1
                            self.push_times.append((time.monotonic(), queue))
                message = self._pubsub.get_message(timeout=0)
            for queue in self.queues:
                self.max_len[queue] = max(self.max_len[queue], int(self.client.llen(queue)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pubsub.close()
        self.client.close()


class AmqpQueueTap:
    """Every message published in a (private) vhost, per target queue, seen through RabbitMQ's firehose.

    Celery publishes to a direct queue through the default exchange (routing key = queue
    name), so a queue bound beside it would see nothing; the firehose (`rabbitmqctl
    trace_on`) copies every publish to `amq.rabbitmq.trace` with the routing keys in its
    headers, and a queue bound there counts them, including those consumed at once.
    """

    def __init__(self, url: str, vhost: str, queues: Sequence[str]) -> None:
        from kombu import Connection, Exchange, Queue

        self.vhost = vhost
        subprocess.run(["rabbitmqctl", "trace_on", "-p", vhost], check=True, capture_output=True, timeout=30)
        self.conn = Connection(url, connect_timeout=3)
        self.channel = self.conn.channel()
        trace = Exchange("amq.rabbitmq.trace", type="topic", durable=True, internal=True, passive=True)
        self.tap = Queue(f"e2e-firehose-{uuid.uuid4().hex[:6]}", trace, routing_key="publish.#", durable=False)
        self.tap(self.channel).declare()
        self.counts: dict[str, int] = dict.fromkeys(queues, 0)

    def pushes(self, queue: str) -> int:
        while True:
            message = self.channel.basic_get(self.tap.name, no_ack=True)
            if message is None:
                break
            headers = message.headers or message.properties.get("application_headers") or {}
            for key in headers.get("routing_keys", []):
                key = key.decode() if isinstance(key, bytes) else key
                if key in self.counts:
                    self.counts[key] += 1
        return self.counts[queue]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.tap(self.channel).delete()
        self.conn.close()
        subprocess.run(["rabbitmqctl", "trace_off", "-p", self.vhost], capture_output=True, timeout=30)


def amqp_queue_depth(url: str, queue: str) -> int | None:
    """Messages ready in an AMQP queue; None when the queue does not exist."""
    from kombu import Connection

    with Connection(url, connect_timeout=3) as conn:
        channel = conn.channel()
        try:
            _, count, _ = channel.queue_declare(queue=queue, passive=True)
            return int(count)
        except Exception:
            return None


class GeneratingMonitor:
    """Polls asset states; records how long each (pair, token) stayed `generating`."""

    def __init__(self, stack: Stack, book: str, interval: float = 0.1) -> None:
        self.stack, self.book, self.interval = stack, book, interval
        self.first: dict[tuple[tuple[str, str, str], int], float] = {}
        self.last: dict[tuple[tuple[str, str, str], int], float] = {}
        self.ended: dict[tuple[tuple[str, str, str], int], float] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="generating-monitor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from animastor_tasks.adapters.postgres.pool import Database

        db = Database(self.stack.settings.database_url, max_size=1)
        try:
            while not self._stop.is_set():
                try:
                    with db.transaction() as conn:
                        rows = conn.execute(
                            "SELECT chapter_id, scene_id, stage, fencing_token FROM asset_states"
                            " WHERE book_id = %s AND state = 'generating'",
                            (self.book,),
                        ).fetchall()
                except Exception as err:  # recorded and reported by the test
                    self.errors.append(repr(err))
                    rows = []
                now = time.monotonic()
                seen = {((c, s, st), int(t)) for c, s, st, t in rows}
                for key in seen:
                    self.first.setdefault(key, now)
                    self.last[key] = now
                for key in set(self.first) - seen - set(self.ended):
                    self.ended[key] = now
                self._stop.wait(self.interval)
        finally:
            db.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def span(self, key: tuple[tuple[str, str, str], int]) -> float:
        return self.ended.get(key, time.monotonic()) - self.first[key]

    def longest(self) -> tuple[float, Any]:
        if not self.first:
            return 0.0, None
        key = max(self.first, key=self.span)
        return self.span(key), key


def generate_lines(proc: Proc, dispatch_id: str) -> list[str]:
    return [line for line in proc.log().splitlines() if f"dispatch={dispatch_id}" in line or f"[{dispatch_id}]" in line]


def running_dispatch(proc: Proc) -> str | None:
    """The dispatch id a GPU worker has started and not yet finished, read from its log."""
    current = None
    for line in proc.log().splitlines():
        if "[GENERATE]" not in line or "dispatch=" not in line:
            continue
        dispatch_id = line.split("dispatch=", 1)[1].split()[0]
        if " started on " in line:
            current = dispatch_id
        elif dispatch_id == current and (" ready sha256=" in line or "fence_rejected" in line or "stopping:" in line):
            current = None
    return current


# ---------------------------------------------------------------------------------------------------------------
# Shared scenarios: one body, run at e2e size by tests/e2e and at fault-suite size by tests/faults.


def sigkill_trials(
    make_stack: Callable[..., Stack],
    figure: Callable[[str], None],
    *,
    kills: int,
    chapters: int,
    scenes: int,
    workers: int = 1,
    job: Mapping[str, Any] | None = None,
    lease_ttl: int = 3,
    book_id: str = "kill-book",
    timeout: float = 90.0,
) -> dict[str, Any]:
    """SIGKILL an image worker in the middle of a job `kills` times while a book's image stage runs.

    `chapters` x `scenes` image jobs of `job` params on `workers` image workers. At most one
    worker is down at a time (the others keep working); lane and book quota equal the worker
    count, so every kill hits a running job and nothing waits queued long enough to lose its
    lease. The presence TTL outlasts a restart, so the queue never looks consumerless (that
    would rightly BLOCK the command). Asserts: every pair ready with exactly one artifact under
    its final token, no killed dispatch ever committed, each killed pair released within lease
    TTL + one reconcile, no pair generating longer than that plus a job. Returns the figures.
    """
    from tests.integration.helpers import make_book

    job = dict(job or {"steps": 4, "step_seconds": 0.25})
    job_seconds = float(job.get("steps", 4)) * float(job.get("step_seconds", 0.0))
    stages = stage_table(
        audio=audio_stage(),
        image=image_stage(params=job, lease_ttl=lease_ttl, lane_limit=workers, book_quota=workers),
    )
    stack = make_stack(stages=stages, presence_ttl_seconds=10)
    cluster, settings = stack.cluster, stack.settings
    images = [cluster.gpu("image", wait=False) for _ in range(workers)]
    cluster.wait_ready(cluster.control(wait=False), *images, cluster.beat(wait=False))
    book = make_book(book_id, chapters=chapters, scenes=scenes)
    stack.rt.catalog.import_book(book)
    pairs = {pair for pair in stack.states(book.book_id) if pair[2] == "image"}
    assert len(pairs) == chapters * scenes

    settle = min(0.3, job_seconds / 3)  # into the job, with most of it still ahead
    monitor = GeneratingMonitor(stack, book.book_id)
    began = time.monotonic()
    try:
        stack.client.regenerate(book.book_id, ["image"])
        done: list[tuple[str, tuple[tuple[str, str, str], int], float]] = []
        while len(done) < kills:
            cluster.wait_ready(*images)  # the last one killed is back: one worker down at a time

            def busy() -> tuple[int, str] | None:
                for i, proc in enumerate(images):
                    dispatch_id = running_dispatch(proc)
                    if dispatch_id is not None:
                        return i, dispatch_id
                return None

            index, dispatch_id = wait_for(busy, 30, what="a job running on an image worker")
            victim = images[index]
            time.sleep(settle)
            assets = stack.asset_rows(book.book_id)
            holder = [(pair, a["token"]) for pair, a in assets.items() if a["dispatch_id"] == dispatch_id]
            if running_dispatch(victim) != dispatch_id or not holder or assets[holder[0][0]]["state"] != "generating":
                continue  # it finished meanwhile; kill the next one
            cluster.kill(victim, signal.SIGKILL)
            done.append((dispatch_id, holder[0], time.monotonic()))
            images[index] = cluster.restart(victim, wait=False)
        cluster.wait_ready(*images)
        rows = stack.wait_commands(book.book_id, ["image"], "completed", timeout=timeout)
    finally:
        monitor.stop()
    elapsed = time.monotonic() - began

    assert monitor.errors == []
    assert rows["image"].progress["ready"] == len(pairs)
    states = stack.states(book.book_id)
    assert {s for (_, _, st), s in states.items() if st == "image"} == {"ready"}
    artifacts = stack.check_artifacts(book.book_id, pairs)  # one row per pair, under its final token
    killed_ids = {d for d, _, _ in done}
    assert not killed_ids & {r["dispatch_id"] for r in artifacts}
    ready_events = stack.events("job.ready", book.book_id)
    assert not killed_ids & {e["dispatch_id"] for e in ready_events}
    assert len(ready_events) == len(pairs), f"{len(ready_events)} job.ready events for {len(pairs)} pairs"

    # A killed job's pair leaves `generating` within lease TTL + one reconcile (+1 s for polling/tick jitter).
    bound = lease_ttl + settings.reconcile_seconds + 1.0
    recoveries = []
    for dispatch_id, key, killed_at in done:
        assert key in monitor.ended, f"{key} (dispatch {dispatch_id}) still generating"
        recoveries.append(monitor.ended[key] - killed_at)
    assert max(recoveries) <= bound, f"recoveries {recoveries} exceed {bound}s"
    # And no pair ever stayed `generating` longer than a job plus that bound.
    longest, which = monitor.longest()
    assert longest <= bound + job_seconds + 0.5, f"{which} generating for {longest:.1f}s"
    expired = stack.events("lease.expired", book.book_id)
    assert len(expired) >= kills
    jobs = len(stack.events("job.started", book.book_id))
    result = {
        "kills": len(done),
        "pairs": len(pairs),
        "jobs_started": jobs,
        "dispatches": len(stack.events("dispatch", book.book_id)),
        "expired": len(expired),
        "elapsed": elapsed,
        "recover_max": max(recoveries),
        "bound": bound,
        "longest": longest,
    }
    figure(
        f"kills {len(done)} on {workers} worker(s), pairs {len(pairs)}, jobs started {jobs}, "
        f"dispatches {result['dispatches']}, leases expired {len(expired)}, lost 0, duplicated 0 (1 artifact and "
        f"1 job.ready per pair), total {elapsed:.1f}s; kill -> pair released max {max(recoveries):.2f}s "
        f"(bound {bound:.0f}s); longest generating {longest:.2f}s"
    )
    return result
