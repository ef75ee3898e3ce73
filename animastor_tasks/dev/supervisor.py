"""The one process supervisor: the demo, the end-to-end tests and the benchmarks start their processes with it.

Every process runs in a session (process group) of its own: a Celery worker forks pool processes, and
signalling the group reaches every one of them, while a terminal's Ctrl-C (sent to the terminal's
foreground group) reaches only the supervising program, so the shutdown happens in one place. Each child
also gets SIGTERM from the kernel if the thread that started it dies without cleaning up (Linux PDEATHSIG), carries
`ANIMASTOR_SUPERVISOR=<token>` in its environment so that a survivor can be found, and writes its output to
`<log dir>/<name>.log`. Groups still running when the interpreter exits are killed (`atexit`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from animastor_tasks.dev.processes import (
    SUPERVISOR_VAR,
    group_members,
    leftovers,
    log_tail,
    marked_processes,
    wait_dead,
)
from animastor_tasks.errors import AnimastorError


class SupervisorError(AnimastorError):
    """A supervised process exited when it should be running, or what was waited for did not happen in time."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwind to the shutdown (BaseException so no `except Exception` eats it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @staticmethod
    def behind(err: BaseException) -> Interrupted | None:
        """The signal behind `err`, where Python wrapped it. *Why:* one that came while a class was being made (a
        module imported lazily, mid-send: Celery's events) became "RuntimeError: Error calling __set_name__", and
        the demo's Ctrl-C exited 1 with a traceback instead of 130."""
        seen: BaseException | None = err
        while seen is not None:
            if isinstance(seen, Interrupted):
                return seen
            seen = seen.__cause__ or seen.__context__
        return None


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


_LIVE_GROUPS: set[int] = set()  # of every supervisor in this interpreter, until stopped
_LIVE_LOCK = threading.Lock()


def _track(pgid: int, live: bool) -> None:
    with _LIVE_LOCK:
        if live:
            _LIVE_GROUPS.add(pgid)
        else:
            _LIVE_GROUPS.discard(pgid)


def _kill_live_groups() -> None:
    """At interpreter exit: kill whatever a crashed caller left running (a failed test, say)."""
    with _LIVE_LOCK:
        groups = list(_LIVE_GROUPS)
    for pgid in groups:
        _signal_group(pgid, signal.SIGKILL)


atexit.register(_kill_live_groups)


@dataclass
class Child:
    """One started process and its log."""

    name: str
    argv: list[str]
    env: dict[str, str]  # what it got on top of the supervisor's environment
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        """Also its process group id: each child leads a group of its own."""
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 15) -> str:
        return log_tail(self.log_path, lines)


class Supervisor:
    """Starts named processes, each in a process group of its own, and stops them, pool children included."""

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
        self.groups: list[int] = []  # every group started and not yet seen empty (its leader's pid)
        self.started = 0  # how many groups were ever started
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

    # -- start ----------------------------------------------------------------------------------------------------

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Child:
        """Start `argv` as `name`, with `env` on top of the supervisor's environment, output to its log."""
        if name in self.children and self.children[name].alive():
            raise SupervisorError(f"{name} is already running (pid {self.children[name].pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}.log"
        with self.shielded(), open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                list(argv),
                env=self._child_env(env),
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session and process group: pgid == pid
                preexec_fn=_child_setup,  # only a prctl and a signal-mask reset: safe with threads
            )
            child = Child(name, list(argv), dict(env or {}), process, log_path)
            self.children[name] = child
            self.groups.append(process.pid)
            self.started += 1
            _track(process.pid, live=True)
        self.say(f"started {name}: pid {process.pid} (process group {process.pid}), log {log_path}")
        return child

    def run(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a one-shot command to completion, output captured; its whole group is killed on timeout."""
        process = subprocess.Popen(
            list(argv),
            env=self._child_env(env),
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_child_setup,
        )
        _track(process.pid, live=True)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            raise SupervisorError(f"{' '.join(argv)} did not finish within {timeout}s:\n{out}\n{err}") from None
        finally:
            _track(process.pid, live=False)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def _child_env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**self.env, **(env or {}), SUPERVISOR_VAR: self.token, "PYTHONUNBUFFERED": "1"}

    # -- watch ----------------------------------------------------------------------------------------------------

    def alive(self, name: str) -> bool:
        child = self.children.get(name)
        return child is not None and child.alive()

    def check(self, *names: str) -> None:
        """Raise `SupervisorError` with the end of its log when one of `names` (default: every child) has exited."""
        for name in names or list(self.children):
            child = self.children.get(name)
            if child is not None and not child.alive():
                raise SupervisorError(
                    f"{name} exited with status {child.process.returncode}; last lines of {child.log_path}:\n"
                    + child.tail()
                )

    def send(self, name: str, sig: int, *, group: bool = True) -> None:
        """Send `sig` to the process group of `name` (the process and its pool children), or only to the process."""
        child = self.children[name]
        if group:
            _signal_group(child.pid, sig)
        else:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(sig)

    # -- stop -----------------------------------------------------------------------------------------------------

    def stop(self, *names: str, grace: float = 15.0, first: int = signal.SIGTERM) -> None:
        """`first` to each process (SIGTERM: a Celery worker's warm shutdown, running tasks finish), all at once;
        what is still running after `grace` gets SIGKILL with its group; then the pool children that outlived
        their parent are killed and waited for.

        The group is resumed (SIGCONT) first: a stopped process would not act on `first`. Pool children are not
        sent `first` themselves: a Celery pool process dies on SIGTERM, taking its running task with it.
        """
        targets = [self.children[n] for n in names if n in self.children]  # still listed if interrupted
        for child in targets:
            _signal_group(child.pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(first)
        deadline = time.monotonic() + grace
        for child in targets:
            while child.alive() and time.monotonic() < deadline and not self.hurry:
                time.sleep(0.05)
            if child.alive():
                self.say(f"{child.name} did not stop in time: SIGKILL to process group {child.pid}")
                _signal_group(child.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(5)
        for child in targets:
            _reap_group(child.pid)
            _track(child.pid, live=False)
            if not group_members(child.pid) and child.pid in self.groups:
                # Empty, its number may be a new session's one day: `stop_all` must not SIGKILL that group.
                self.groups.remove(child.pid)
            if self.children.get(child.name) is child:
                del self.children[child.name]
            self.say(f"stopped {child.name} (pid {child.pid}, exit status {child.process.returncode})")

    def stop_all(self, grace: float = 15.0) -> None:
        """Stop every child, the last started first (all signalled at once: it is faster), then kill whatever is
        left of a group not yet seen empty or carries our token (a grandchild that left its group is ours all the
        same)."""
        self.stop(*reversed(list(self.children)), grace=grace)
        for pgid in self.groups:
            _reap_group(pgid)
        for pid in marked_processes(self.token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_dead(pid, 5.0)

    def survivors(self) -> list[int]:
        """Processes we started that are still alive: in one of our groups or carrying our token."""
        return leftovers(self.token, self.groups)


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    check: Callable[[], None] | None = None,
    interval: float = 0.1,
) -> Any:
    """Poll `predicate` until it returns something truthy, and return that.

    `check` runs between polls, say `supervisor.check(...)` to fail at once when a process being waited on
    has died instead of at the timeout. `SupervisorError` naming `what` when `timeout` passes.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if check is not None:
            check()
        if time.monotonic() >= deadline:
            raise SupervisorError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _reap_group(pgid: int, timeout: float = 5.0) -> None:
    """Pool children that outlived their parent: SIGKILL and wait until they are gone."""
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        _signal_group(pgid, signal.SIGKILL)
        time.sleep(0.05)
