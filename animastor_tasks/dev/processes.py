"""What /proc says about processes, and signalling them, for the supervisor and the local store servers.

Why one place: the supervisor must find every process it started (its process groups, the token in their
environment) and the local servers must never signal a pid that now belongs to someone else; both read the
same /proc fields the same way. Without /proc (not Linux) survivors cannot be looked for, only signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

#: Every supervised child carries `ANIMASTOR_SUPERVISOR=<token>`, so a survivor can be found by its environment.
SUPERVISOR_VAR = "ANIMASTOR_SUPERVISOR"
_GONE = ("Z", "X")  # zombie or dead: exited, only waiting to be reaped


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of `pid`, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an orphaned daemon may wait for a PID 1 that never reaps)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = proc_stat(pid)
    return stat is None or stat[0] not in _GONE


def owned_by(pid: int, marker: str) -> bool:
    """True when `pid` is alive and its command line names `marker` (a PGDATA or a Redis socket of ours).

    Why: a state file that outlived a reboot holds pids that may now belong to unrelated processes,
    which must never be signalled. Without /proc only liveness can be checked.
    """
    if pid <= 0 or not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return False
    return os.fsencode(marker) in cmdline


def read_pid(path: Path) -> int:
    """The pid on the first line of a pid file."""
    return int(path.read_text().splitlines()[0].strip())


def wait_dead(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` for `pid` to be gone; True when it is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.02)
    return not pid_alive(pid)


def terminate(pid: int, first: signal.Signals) -> None:
    """`first`, then SIGKILL when the process is still there after a grace period."""
    for sig, grace in ((first, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if wait_dead(pid, grace):
            return


def _live_pids() -> Iterator[int]:
    if not os.path.isdir("/proc"):
        return
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    members = []
    for pid in _live_pids():
        stat = proc_stat(pid)
        if stat is not None and stat[1] == pgid and stat[0] not in _GONE:
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
        stat = proc_stat(pid)
        if needle in environ.split(b"\0") and stat is not None and stat[0] not in _GONE:
            found.append(pid)
    return found


def leftovers(token: str, groups: Iterable[int]) -> list[int]:
    """Live processes carrying a supervisor `token` or belonging to one of the process `groups`."""
    found = set(marked_processes(token))
    for pgid in groups:
        found.update(group_members(pgid))
    return sorted(found)


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log file, "(no log)" when there is none."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
