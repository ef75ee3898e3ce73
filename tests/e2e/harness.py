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

from animastor_tasks.adapters.redis_store import Coordination
from animastor_tasks.celery_config import CONTROL_QUEUE
from animastor_tasks.client import Client
from animastor_tasks.config import Settings
from animastor_tasks.flow.runtime import Runtime

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


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll until `predicate()` is truthy; its value, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not met within {timeout:.1f}s")
        time.sleep(interval)


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
    ) -> Proc:
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
        return self.worker(
            list(proc.queues), base=base, concurrency=concurrency, env=proc.env, wait=wait, timeout=timeout
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
        from animastor_tasks.adapters.postgres import Database

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
