"""Real Celery workers and beat as subprocesses of a test, under the one `Supervisor` of animastor_tasks.dev.

Each process gets a unique name (a test may kill one and start its successor), is ready when its log and
its heartbeat say so, and `Cluster.close()` always stops every process group it started, whatever state
the test left them in (stopped, killed, with orphaned pool children). Logs: `<folder>/logs/<name>.log`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from animastor_tasks.adapters.redis.presence import PresenceStore
from animastor_tasks.dev.celery_commands import celery_argv
from animastor_tasks.dev.supervisor import Child, Supervisor, SupervisorError, wait_until
from animastor_tasks.domain.registry import CONTROL_QUEUE
from tests.support import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]


def pool_children(pid: int) -> list[int]:
    """Direct children of `pid` (a prefork worker's pool processes), read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


@dataclass
class Proc:
    """One started worker or beat: the supervised process, what it is for and, once ready, its node name."""

    child: Child
    role: str  # "control", "gpu" or "beat"
    queues: tuple[str, ...]
    hostname: str | None = None  # the worker's node name as it advertises it (name@host)

    @property
    def name(self) -> str:
        return self.child.name

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        return self.child.process

    @property
    def started_at(self) -> float:
        return self.child.started_at

    def alive(self) -> bool:
        return self.child.alive()

    def log(self) -> str:
        return self.child.log()

    def tail(self, lines: int = 40) -> str:
        return self.child.tail(lines)

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
    """Starts, signals, restarts and always stops worker and beat subprocesses.

    `presence` answers which workers advertise a live heartbeat (a GPU worker is ready once it does).
    """

    def __init__(self, folder: Path, env: Mapping[str, str], presence: PresenceStore) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.presence = presence
        self.supervisor = Supervisor({**os.environ, **env}, folder / "logs", say=lambda _: None, cwd=REPO_ROOT)
        self.procs: list[Proc] = []
        self._seq = 0

    # -- starting ------------------------------------------------------------------------------
    def _unique(self, base: str) -> str:
        self._seq += 1
        return f"{base}-{self._seq}-{uuid.uuid4().hex[:6]}"

    def _spawn(
        self, name: str, role: str, argv: list[str], queues: Sequence[str], env: Mapping[str, str] | None
    ) -> Proc:
        proc = Proc(self.supervisor.start(name, argv, env), role, tuple(queues))
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
        argv = celery_argv(
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
            "--without-gossip",  # as `animastor-tasks worker` runs it (see process_commands.worker)
            "-P",
            "prefork",
            *args,
        )
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
        argv = celery_argv(
            "beat",
            "-s",
            str(self.folder / f"{name}-schedule"),
            "--pidfile",
            str(self.folder / f"{name}.pid"),
            "-l",
            "info",
        )
        proc = self._spawn(name, "beat", argv, (), env)
        if wait:
            self.wait_ready(proc, timeout=timeout)
        return proc

    # -- readiness --------------------------------------------------------------------------------
    def advertised(self, proc: Proc, queue: str | None = None) -> str | None:
        """The worker's hostname if its heartbeat is live under `queue` (default: its first queue)."""
        queue = queue or proc.queues[0]
        live = self.presence.live_consumers([queue]).get(queue, {})
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
            wait_until(all_ready, timeout, "processes ready")
        except SupervisorError as err:
            names = ", ".join(p.name for p in pending)
            raise AssertionError(f"{err}: still starting: {names}\n{self.report(pending)}") from None

    # -- signals ------------------------------------------------------------------------------------
    def send_signal(self, proc: Proc, sig: int, *, group: bool = True) -> None:
        """Send `sig` to the process group (worker + pool children), or only to the main process."""
        self.supervisor.send(proc.name, sig, group=group)

    def kill(self, proc: Proc, sig: int = signal.SIGKILL, *, group: bool = True) -> None:
        self.send_signal(proc, sig, group=group)
        if sig == signal.SIGKILL:
            proc.popen.wait(timeout=10)

    def stop(self, proc: Proc, timeout: float = 8.0) -> int | None:
        """SIGTERM to the main process (a clean Celery shutdown), then SIGKILL the group if it lingers."""
        self.supervisor.stop(proc.name, grace=timeout)
        return proc.popen.returncode

    def restart(self, proc: Proc, *, wait: bool = True, timeout: float = 45.0) -> Proc:
        """Stop `proc` if it still runs and start the same kind of process under a new unique name."""
        if proc.alive():
            self.stop(proc)
        if proc.role == "beat":
            return self.beat(env=proc.child.env, wait=wait, timeout=timeout)
        base = proc.name.rsplit("-", 2)[0]
        argv = proc.child.argv
        concurrency = int(argv[argv.index("-c") + 1])
        extra = argv[argv.index("prefork") + 1 :]
        return self.worker(
            list(proc.queues),
            base=base,
            concurrency=concurrency,
            env=proc.child.env,
            wait=wait,
            timeout=timeout,
            args=extra,
        )

    def close(self) -> None:
        """Stop everything this cluster started, whatever state it is in."""
        self.supervisor.stop_all(grace=6.0)

    # -- one-shot commands ------------------------------------------------------------------------------
    def run(
        self, args: Sequence[str], *, timeout: float = 60.0, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `celery -A animastor_tasks <args>` to completion (its own session, killed on timeout)."""
        return self.supervisor.run(celery_argv(*args), timeout=timeout, env=env)

    # -- diagnostics ---------------------------------------------------------------------------------------
    def report(self, procs: Iterable[Proc] | None = None, lines: int = 40) -> str:
        chunks = []
        for proc in procs if procs is not None else self.procs:
            state = "running" if proc.alive() else f"exited {proc.popen.returncode}"
            chunks.append(
                f"----- {proc.name} ({proc.role}, pid {proc.pid}, {state}) {proc.child.log_path}\n{proc.tail(lines)}"
            )
        return "\n".join(chunks)

    def logs_mentioning(self, needle: str) -> list[tuple[Proc, str]]:
        return [(p, line) for p in self.procs for line in p.log().splitlines() if needle in line]
