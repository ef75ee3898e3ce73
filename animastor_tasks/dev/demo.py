"""`animastor-tasks demo` (`make demo`): the whole system on one machine, scripted, in well under a minute.

The story: stores (the configured ones, else local embedded ones) -> migrate -> a control worker,
one worker per GPU stage, beat, Flower and the metrics exporter -> import the sample book ->
`regenerate --stage all` with live progress -> a BLOCKED command (the image worker is stopped)
-> Stop All in the middle of a slow run -> where the artifacts, Flower and the metrics are.

Every process runs in a session (process group) of its own under `Supervisor`: a terminal's
Ctrl-C reaches only the demo, which then stops every group itself, pool children included,
on a normal exit, Ctrl-C or SIGTERM alike; a second Ctrl-C skips the grace period. Children
also get SIGTERM from the kernel if the demo dies without cleaning up (Linux PDEATHSIG).
Each child carries `ANIMASTOR_SUPERVISOR=<token>` in its environment so that anyone (the
tests do) can find a survivor. Logs go to `<run dir>/logs/<process>.log`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from animastor_tasks.errors import AnimastorError, ConfigError

SUPERVISOR_VAR = "ANIMASTOR_SUPERVISOR"
TERMINAL = frozenset({"completed", "cancelled", "failed", "blocked"})
#: Stage table used when ANIMASTOR_STAGES is unset: the builtin generator with a little work per
#: step, so progress is visible and the whole book still takes a few seconds.
DEMO_STAGES: dict[str, dict[str, Any]] = {
    "audio": {
        "queue": "gpu.audio",
        "input": "text",
        "media_type": "audio/wav",
        "params": {"steps": 4, "step_seconds": 0.04},
    },
    "image": {
        "queue": "gpu.image",
        "input": "prompt",
        "media_type": "image/png",
        "params": {"steps": 4, "step_seconds": 0.04},
    },
}
#: Seconds per step of the slowed-down worker of the Stop All part (4 steps: 2 s per scene).
SLOW_STEP_SECONDS = 0.5
CONTROL_NAME = "control worker"
BEAT_NAME = "beat"
FLOWER_NAME = "flower"
METRICS_NAME = "metrics exporter"


class DemoError(AnimastorError):
    """The demo could not carry on (a process died, something did not happen in time)."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwind to the shutdown (BaseException so no `except Exception` eats it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ---------------------------------------------------------------------------------------------------------------------
# Processes

_PR_SET_PDEATHSIG = 1
try:
    _PRCTL: Any = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


def _child_setup() -> None:
    """Runs in the child between fork and exec: die with the supervisor, take signals normally."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of `pid`, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def _live_pids() -> Iterator[int]:
    if not os.path.isdir("/proc"):  # not Linux: survivors cannot be looked for, only signalled
        return
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    members = []
    for pid in _live_pids():
        stat = _proc_stat(pid)
        if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
            members.append(pid)
    return members


def marked_processes(token: str) -> list[int]:
    """Live processes whose environment carries `ANIMASTOR_SUPERVISOR=<token>`."""
    needle = f"{SUPERVISOR_VAR}={token}".encode()
    found = []
    for pid in _live_pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        stat = _proc_stat(pid)
        if needle in environ.split(b"\0") and stat is not None and stat[0] not in ("Z", "X"):
            found.append(pid)
    return found


class Supervisor:
    """Starts processes each in a process group of its own and stops them, pool children included.

    Why groups: a Celery worker forks pool processes; signalling the group reaches every one of
    them, and a terminal's Ctrl-C (sent to the terminal's foreground group) reaches only us, so
    the shutdown happens in one place.
    """

    def __init__(
        self,
        env: Mapping[str, str],
        log_dir: Path,
        *,
        say: Callable[[str], None] = print,
        cwd: Path | None = None,
    ) -> None:
        self.env = dict(env)
        self.log_dir = log_dir
        self.say = say
        self.cwd = cwd
        self.token = secrets.token_hex(8)
        self.children: dict[str, Child] = {}
        self.groups: list[int] = []  # every group ever started (its leader's pid)
        self.hurry = False  # set by a second Ctrl-C: no more grace periods
        self._shield = 0
        self._pending: int | None = None

    # -- signals --------------------------------------------------------------------------------------------------

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        """Handler for SIGINT/SIGTERM: interrupt the caller, never between a fork and its bookkeeping."""
        if self._shield:
            self._pending = signum
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        self._shield += 1
        try:
            yield
        finally:
            self._shield -= 1
            if not self._shield and self._pending is not None:
                signum, self._pending = self._pending, None
                raise Interrupted(signum)

    # -- start / stop ---------------------------------------------------------------------------------------------

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Child:
        if name in self.children and self.children[name].process.poll() is None:
            raise DemoError(f"{name} is already running (pid {self.children[name].pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}.log"
        child_env = {**self.env, **(env or {}), SUPERVISOR_VAR: self.token, "PYTHONUNBUFFERED": "1"}
        with self.shielded(), open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                list(argv),
                env=child_env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session and process group: pgid == pid
                preexec_fn=_child_setup,  # only a prctl and a signal-mask reset: safe with threads
            )
            child = Child(name, list(argv), process, log_path)
            self.children[name] = child
            self.groups.append(process.pid)
        self.say(f"started {name}: pid {process.pid} (process group {process.pid}), log {log_path}")
        return child

    def alive(self, name: str) -> bool:
        child = self.children.get(name)
        return child is not None and child.process.poll() is None

    def check(self, *names: str) -> None:
        """Raise `DemoError` with the end of its log when one of `names` has exited."""
        for name in names:
            child = self.children.get(name)
            if child is not None and child.process.poll() is not None:
                raise DemoError(
                    f"{name} exited with status {child.process.returncode}; last lines of {child.log_path}:\n"
                    + tail(child.log_path)
                )

    def stop(self, *names: str, grace: float = 15.0) -> None:
        """SIGTERM each group, wait up to `grace` (Celery finishes running tasks), then SIGKILL what is left."""
        targets = [self.children[n] for n in names if n in self.children]  # still listed if interrupted
        for child in targets:
            _signal_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in targets:
            while child.process.poll() is None and time.monotonic() < deadline and not self.hurry:
                time.sleep(0.05)
            if child.process.poll() is None:
                self.say(f"{child.name} did not stop in time: SIGKILL to process group {child.pid}")
                _signal_group(child.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(5)
        for child in targets:
            _reap_group(child.pid)
            if self.children.get(child.name) is child:
                del self.children[child.name]
            self.say(f"stopped {child.name} (pid {child.pid}, exit status {child.process.returncode})")

    def stop_all(self, grace: float = 15.0) -> None:
        """Stop every running child, the last started first (all signalled at once: it is faster)."""
        self.stop(*reversed(list(self.children)), grace=grace)
        for pid in marked_processes(self.token):  # a grandchild that left its group: ours all the same
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def survivors(self) -> list[int]:
        """Processes we started that are still alive: in one of our groups or carrying our token."""
        found = set(marked_processes(self.token))
        for pgid in self.groups:
            found.update(group_members(pgid))
        return sorted(found)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _reap_group(pgid: int, timeout: float = 5.0) -> None:
    """Pool children that outlived their parent: SIGKILL and wait until they are gone."""
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        _signal_group(pgid, signal.SIGKILL)
        time.sleep(0.05)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def port_setting(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ConfigError(f"{name}={raw!r} is not a port number")
    return int(raw)


def port_or_free(address: str, port: int) -> int:
    """`port` when nothing listens on it, else a free one (a second demo must not fail on 5555)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return free_port(address)
    return port


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, check: Callable[[], None] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if check is not None:
            check()
        if time.monotonic() >= deadline:
            raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "animastor_tasks", *args]


def worker_argv(queue: str, hostname: str, concurrency: int = 1) -> list[str]:
    """The same worker `animastor-tasks worker [--stage S]` starts, minus mingle/gossip (faster start)."""
    return celery_argv(
        "worker",
        "-Q",
        queue,
        "-c",
        str(concurrency),
        "--prefetch-multiplier",
        "1",
        "-n",
        hostname,
        "-E",
        "-l",
        "INFO",
        "--without-mingle",
        "--without-gossip",
    )


def flower_config_path() -> Path:
    """`flowerconfig.py` of the source checkout (or the current directory)."""
    for candidate in (Path(__file__).resolve().parents[1] / "flowerconfig.py", Path.cwd() / "flowerconfig.py"):
        if candidate.is_file():
            return candidate
    raise DemoError("flowerconfig.py not found: run the demo from the animastor-tasks source checkout")


def slowed(table: Mapping[str, Any], stage: str, step_seconds: float) -> dict[str, Any]:
    """The stage table with `stage` made slow (its generator sleeps `step_seconds` per step)."""
    copy = json.loads(json.dumps(table))
    copy[stage]["params"] = {**copy[stage].get("params", {}), "step_seconds": step_seconds}
    return copy


def _render(rows: Sequence[Any]) -> Group:
    progress = Progress(
        TextColumn("{task.fields[stage]:<6}"),
        BarColumn(bar_width=30),
        TextColumn("{task.completed:>3}/{task.total:<3}"),
        TextColumn("{task.fields[counts]}"),
        TextColumn("[bold]{task.fields[status]}[/bold] {task.fields[reason]}"),
    )
    for row in rows:
        p = row.progress
        counts = " ".join(f"{s}={p.get(s, 0)}" for s in ("generating", "pending", "dirty", "failed") if p.get(s))
        progress.add_task(
            row.command_id[:8],
            total=row.targets,
            completed=p.get("ready", 0) + p.get("failed", 0),
            stage=row.stage,
            counts=counts,
            status=row.status,
            reason=row.reason or "",
        )
    return Group(progress)


# ---------------------------------------------------------------------------------------------------------------------
# The story


@dataclass
class Demo:
    keep_running: bool = False
    run_dir: Path | None = None
    console: Console = field(default_factory=Console)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from animastor_tasks.dev import stores as devstack

        self.started = time.monotonic()
        self.dir: Path = (self.run_dir or devstack.default_data_dir() / "demo").resolve()
        self.log_dir = self.dir / "logs"
        self.env: dict[str, str] = dict(os.environ)
        self.supervisor = Supervisor(self.env, self.log_dir, say=self.say)
        self.rt: Any = None
        self.client: Any = None
        self.local_stores: Any = None
        self.stopping = False

    # -- output ---------------------------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.console.print(f"[DEMO] {text}", highlight=False, markup=False, soft_wrap=True)

    def step(self, title: str) -> None:
        elapsed = time.monotonic() - self.started
        self.console.rule(f"[bold]{title}[/bold] [dim](t={elapsed:.1f}s)[/dim]")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.timings[name] = time.monotonic() - started

    # -- main -----------------------------------------------------------------------------------------------------

    def run(self) -> int:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for old in self.log_dir.glob("*.log"):
            old.unlink()
        self.say(f"run directory {self.dir} (supervisor token {self.supervisor.token})")
        with self.phase("stores"):
            self.prepare_stores()
        with self.phase("processes"):
            self.start_stack()
        with self.phase("import"):
            book = self.import_book()
        with self.phase("regenerate all"):
            self.regenerate_all(book)
        with self.phase("blocked"):
            self.show_blocked(book)
        with self.phase("stop all"):
            self.show_stop_all(book)
        self.summary()
        if self.keep_running:
            self.stay_up()
        return 0

    def prepare_stores(self) -> None:
        from animastor_tasks.adapters.postgres.pool import migrate
        from animastor_tasks.config import Settings
        from animastor_tasks.dev import stores as devstack
        from animastor_tasks.flow.runtime import Runtime

        self.step("1. stores")
        overrides, lines = devstack.ensure_stores(self.env, log=self.say)
        self.env.update(overrides)
        if overrides:
            # Stop at the end only the embedded servers this run started; ones found running stay up.
            if any("reusing embedded" in line for line in lines):
                self.say("the local stores were already running: they stay up (`animastor-tasks down` stops them)")
            else:
                self.local_stores = devstack.LocalStores()
        self.env.setdefault("ANIMASTOR_STAGES", json.dumps(DEMO_STAGES))
        self.env.setdefault("ANIMASTOR_TICK_SECONDS", "1")
        self.settings = Settings.from_env(self.env)
        self.supervisor.env.update(self.env)
        self.rt = Runtime.build(self.settings)
        applied = migrate(self.rt.db)
        self.say(f"migrations: {', '.join(applied) if applied else 'database is up to date'}")

    def start_stack(self) -> None:
        from animastor_tasks.client import Client
        from animastor_tasks.worker.celery_config import CONTROL_QUEUE

        self.step("2. processes: control worker, one worker per GPU stage, beat, Flower, metrics")
        stages = self.settings.registry
        busy = {q: sorted(h) for q, h in self.rt.coord.live_consumers(list(stages.queues())).items() if h}
        if busy:
            self.say(f"note: other workers already consume these queues: {busy}; the BLOCKED step may not block")
        self.flower_address = self.env.get("ANIMASTOR_FLOWER_ADDRESS", "").strip() or "127.0.0.1"
        self.flower_port = port_or_free(self.flower_address, port_setting(self.env, "ANIMASTOR_FLOWER_PORT", 5555))
        self.metrics_port = port_or_free("127.0.0.1", port_setting(self.env, "ANIMASTOR_METRICS_PORT", 9808))
        flower_env = {"ANIMASTOR_FLOWER_ADDRESS": self.flower_address, "ANIMASTOR_FLOWER_PORT": str(self.flower_port)}
        if self.env.get("ANIMASTOR_FLOWER_BASIC_AUTH", "").strip():
            self.credentials = "ANIMASTOR_FLOWER_BASIC_AUTH from your environment"
        else:
            path = self.dir / "flower-credentials"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(f"demo:{secrets.token_urlsafe(18)}\n")
            flower_env["ANIMASTOR_FLOWER_BASIC_AUTH"] = path.read_text().strip()
            self.credentials = f"user 'demo', password generated for this run in {path} (mode 600)"

        sup = self.supervisor
        sup.start(CONTROL_NAME, worker_argv(CONTROL_QUEUE, "control@%h", concurrency=2))
        for spec in stages.stages:
            sup.start(self.worker_name(spec.name), worker_argv(spec.queue, f"{spec.name}@%h"))
        sup.start(BEAT_NAME, celery_argv("beat", "-l", "INFO", "-s", str(self.dir / "celerybeat-schedule")))
        sup.start(FLOWER_NAME, celery_argv("flower", f"--conf={flower_config_path()}"), env=flower_env)
        sup.start(
            METRICS_NAME,
            [sys.executable, "-m", "animastor_tasks.operator.cli", "metrics", "--port", str(self.metrics_port)],
        )
        names = list(sup.children)
        queues = [CONTROL_QUEUE, *stages.queues()]
        self.wait_consumers(queues, names)
        self.flower_url = f"http://{self.flower_address}:{self.flower_port}/"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        wait_until(lambda: http_ok(self.flower_url + "healthcheck"), 30, "Flower", lambda: sup.check(*names))
        wait_until(lambda: http_ok(self.metrics_url), 30, "the metrics exporter", lambda: sup.check(*names))
        self.say(f"all {len(names)} processes are up; every queue has a live consumer")
        self.client = Client(self.settings, timeout=30)

    def worker_name(self, stage: str) -> str:
        return f"{stage} worker"

    def wait_consumers(self, queues: Sequence[str], names: Sequence[str], timeout: float = 60) -> None:
        def ready() -> bool:
            live = self.rt.coord.live_consumers(list(queues))
            return all(live.get(q) for q in queues)

        wait_until(ready, timeout, f"consumers on {', '.join(queues)}", lambda: self.supervisor.check(*names))

    def import_book(self) -> str:
        from animastor_tasks.dev.samples import load_sample_book, sample_book_path
        from animastor_tasks.flow import commands

        self.step("3. import the sample book")
        book = load_sample_book()
        summary = self.rt.catalog.import_book(book)
        scenes = sum(len(c.scenes) for c in book.chapters)
        self.say(
            f"{'imported' if summary.created else 're-imported'} {book.book_id!r} from {sample_book_path()}: "
            f"{len(book.chapters)} chapters, {scenes} scenes"
        )
        layers = commands.set_layers(self.rt, book.book_id, list(self.settings.registry.names()), [])
        self.say("layers: " + ", ".join(f"{k}={'on' if v else 'off'}" for k, v in layers.items()))
        busy = [s for *_, s, _ in self.rt.ledger.scene_states(book.book_id) if s in ("pending", "generating")]
        if busy:
            self.say(f"{len(busy)} pair(s) still in flight from an earlier run: Stop All first, for a clean start")
            self.client.cancel(book.book_id, "demo: clean start")
        return str(book.book_id)

    def regenerate(self, book: str, stages: list[str]) -> list[str]:
        stage_text = " ".join(f"--stage {s}" for s in stages)
        self.say(f"$ animastor-tasks regenerate {book} {stage_text}")
        result = self.client.regenerate(book, stages)
        for skipped in result["skipped"]:
            self.say(f"skipped {skipped['stage']}: {skipped['reason']}")
        return [str(c["command_id"]) for c in result["commands"]]

    def watch(
        self, command_ids: list[str], timeout: float, until: Callable[[list[Any]], bool] | None = None
    ) -> list[Any]:
        """Live progress bars until every command is terminal (or `until` holds)."""
        names = list(self.supervisor.children)

        def done(rows: list[Any]) -> bool:
            return all(r.status in TERMINAL for r in rows) or (until is not None and until(rows))

        deadline = time.monotonic() + timeout
        rows = self.rt.ledger.commands(command_ids=command_ids)
        with Live(_render(rows), console=self.console, refresh_per_second=8) as live:
            while not done(rows):
                if time.monotonic() > deadline:
                    raise DemoError(
                        f"commands not finished after {timeout:.0f}s: {[(r.stage, r.status) for r in rows]}"
                    )
                self.supervisor.check(*names)
                time.sleep(0.2)
                rows = self.rt.ledger.commands(command_ids=command_ids)
                live.update(_render(rows))
        if not self.console.is_terminal:
            self.console.line()  # a log or a pipe gets the final bars without their closing newline
        return rows

    def regenerate_all(self, book: str) -> None:
        self.step("4. regenerate --stage all: one command per stage, jobs on the GPU queues")
        started = time.monotonic()
        rows = self.watch(self.regenerate(book, ["all"]), timeout=60)
        for row in rows:
            self.say(f"{row.stage}: {row.status}, {row.progress.get('ready', 0)}/{row.targets} ready")
        if any(r.status != "completed" for r in rows):
            raise DemoError(f"regenerate --stage all did not complete: {[(r.stage, r.status) for r in rows]}")
        self.say(f"whole book generated in {time.monotonic() - started:.1f}s")

    def show_blocked(self, book: str) -> None:
        stage = "image" if "image" in self.settings.registry else self.settings.registry.names()[-1]
        spec = self.settings.registry.get(stage)
        self.step(f"5. BLOCKED: no worker consumes {spec.queue}")
        self.say(f"stopping the {stage} worker (as if its GPU host went away)")
        self.supervisor.stop(self.worker_name(stage))
        wait_until(
            lambda: not self.rt.coord.live_consumers([spec.queue]).get(spec.queue),
            self.settings.presence_ttl_seconds + 5,
            f"{spec.queue} to lose its consumer",
        )
        rows = self.watch(self.regenerate(book, [stage]), timeout=30)
        for row in rows:
            self.say(f"command {row.command_id[:8]} ({row.stage}): {row.status.upper()} reason={row.reason}")
        if not rows or rows[0].status != "blocked":
            raise DemoError(f"expected a BLOCKED command, got {[(r.status, r.reason) for r in rows]}")
        self.say(
            f"how to fix: start a worker for the stage (`animastor-tasks worker --stage {stage}`), "
            "then send the command again; a BLOCKED command is never retried on its own"
        )
        self.supervisor.start(self.worker_name(stage), worker_argv(spec.queue, f"{stage}@%h"))
        self.say(f"restarted the {stage} worker (`animastor-tasks queues` shows its consumer again)")

    def show_stop_all(self, book: str) -> None:
        stage = "audio" if "audio" in self.settings.registry else self.settings.registry.names()[0]
        spec = self.settings.registry.get(stage)
        self.step(f"6. Stop All in the middle of a slow {stage} run")
        table = json.loads(self.env["ANIMASTOR_STAGES"]) if self.env.get("ANIMASTOR_STAGES") else DEMO_STAGES
        slow = json.dumps(slowed(table, stage, SLOW_STEP_SECONDS))
        self.say(f"restarting the {stage} worker with a slow generator (step_seconds={SLOW_STEP_SECONDS})")
        self.supervisor.stop(self.worker_name(stage))
        self.supervisor.start(
            self.worker_name(stage), worker_argv(spec.queue, f"{stage}@%h"), env={"ANIMASTOR_STAGES": slow}
        )
        queues = [q for q in self.settings.registry.queues()]
        self.wait_consumers(queues, list(self.supervisor.children))
        ids = self.regenerate(book, [stage])
        self.watch(ids, timeout=60, until=lambda rows: sum(r.progress.get("ready", 0) for r in rows) >= 1)
        self.say(f"$ animastor-tasks cancel {book}   (Stop All)")
        result = self.client.cancel(book, "demo: Stop All")
        self.say(
            f"cancelled {len(result['cancelled_commands'])} command(s), released {result['released']} pair(s), "
            f"revoked {result['revoked']} job(s)"
        )

        def settled() -> bool:
            return not any(s == "generating" for *_, s, _ in self.rt.ledger.scene_states(book))

        wait_until(settled, 10, "the book to have no generating pair")
        time.sleep(0.5)  # the running job notices the flag within its watcher's poll (0.25 s)
        rows = self.rt.ledger.commands(command_ids=ids)
        self.console.print(_render(rows))
        states: dict[str, int] = {}
        for _, _, st, state, _ in self.rt.ledger.scene_states(book):
            if st == stage:
                states[state] = states.get(state, 0) + 1
        self.say(f"{stage} after Stop All: " + ", ".join(f"{k}={v}" for k, v in sorted(states.items())))
        if any(r.status != "cancelled" for r in rows) or states.get("generating") or states.get("pending"):
            raise DemoError(f"Stop All left work behind: {states}, {[r.status for r in rows]}")
        self.say("nothing of the book is queued or running; only a new regenerate starts work again")
        if self.keep_running:
            self.supervisor.stop(self.worker_name(stage))
            self.supervisor.start(self.worker_name(stage), worker_argv(spec.queue, f"{stage}@%h"))

    def summary(self) -> None:
        self.step("7. where things are")
        root = Path(self.settings.artifact_root).expanduser()
        root = root if root.is_absolute() else Path.cwd() / root
        files = sum(1 for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
        table = Table(show_header=False, box=None)
        table.add_row("artifacts", f"{root} ({files} files, named by sha256)")
        table.add_row("Flower", f"{self.flower_url} (basic auth: {self.credentials})")
        table.add_row("metrics", f"{self.metrics_url} (Prometheus text format)")
        table.add_row("logs", str(self.log_dir))
        table.add_row("timings", ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items()))
        table.add_row("total", f"{time.monotonic() - self.started:.1f}s")
        self.console.print(table)

    def stay_up(self) -> None:
        self.say("--keep-running: the stack stays up; press Ctrl-C to stop every process")
        names = list(self.supervisor.children)
        while True:
            self.supervisor.check(*names)
            time.sleep(1)

    # -- shutdown -------------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop everything this run started; safe to call at any point of the story."""
        self.stopping = True
        self.step("shutdown")
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        self.supervisor.stop_all()
        if self.rt is not None:
            with contextlib.suppress(Exception):
                self.rt.close()
        if self.local_stores is not None:
            for line in self.local_stores.stop():
                self.say(line)
        left = self.supervisor.survivors()
        if left:
            self.say(f"WARNING: processes still alive: {left}")
        else:
            self.say(f"all {len(self.supervisor.groups)} process groups stopped; nothing left running")


def main(*, keep_running: bool = False, run_dir: Path | None = None) -> int:
    """Run the demo; 0 when the story completed, 128+N after signal N, raises on a store/broker outage."""
    demo = Demo(keep_running=keep_running, run_dir=run_dir)
    sup = demo.supervisor

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if demo.stopping:
            sup.hurry = True  # a second Ctrl-C: no more waiting for graceful exits
            return
        sup.on_signal(signum, frame)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        try:
            code = demo.run()
        except Interrupted as err:
            demo.say(f"{err} received: stopping everything this demo started")
            code = 128 + err.signum
        except DemoError as err:
            demo.say(f"error: {err}")
            code = 1
    finally:
        demo.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
