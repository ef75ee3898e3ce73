"""The control host's own stores, each started inside its namespace and listening on its bridge address:
PostgreSQL, Redis, RabbitMQ and (once the artifact store has it) the S3 server.

Why their own and not the machine's: a partition must cut a GPU host off from the very servers its
workers use, and the machine's servers listen on the root namespace's loopback, out of the hosts' reach.
Each runs in the foreground under a `Supervisor` (logs in `<folder>/logs`); PostgreSQL and RabbitMQ run as
their Debian system users (PostgreSQL refuses root), with data directories under the system temp directory
(pytest's is private to root). Standard ports: each namespace has a port space of its own.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from animastor_tasks.dev.supervisor import Supervisor
from tests.support import wait_for
from tests.support.netns import CONTROL_DATA, Host

if TYPE_CHECKING:
    from animastor_tasks.dev.s3_server import S3Server

PG_PORT, REDIS_PORT, AMQP_PORT, S3_PORT = 5432, 6379, 5672, 9000
DATABASE = "animastor"
RABBIT_NODE = "rabbit@localhost"
S3_BUCKET = "animastor"


def postgres_bin() -> Path | None:
    """Debian's newest PostgreSQL binaries (`/usr/lib/postgresql/<major>/bin`)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def missing_tools() -> list[str]:
    """What the control host needs and this machine lacks."""
    lacks = []
    if postgres_bin() is None:
        lacks.append("PostgreSQL server binaries (/usr/lib/postgresql/*/bin, apt: postgresql)")
    if shutil.which("redis-server") is None:
        lacks.append("redis-server (apt: redis-server)")
    if not Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists():
        lacks.append("rabbitmq-server (apt: rabbitmq-server)")
    for user in ("postgres", "rabbitmq"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            lacks.append(f"system user {user}")
    return lacks


def _as_user(user: str) -> list[str]:
    entry = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups"]


def _chown_tree(path: Path, user: str) -> None:
    entry = pwd.getpwnam(user)
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, d) for d in dirs), *(os.path.join(root, f) for f in files)]:
            os.chown(name, entry.pw_uid, entry.pw_gid)


def listening(address: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=0.5):
        return True
    return False


class ControlServices:
    """The stores of the control host `host`, started together; `close()` stops them and removes their data."""

    def __init__(self, host: Host, folder: Path, *, rabbitmq: bool = True, s3: bool = True) -> None:
        self.host = host
        self.data = Path(tempfile.mkdtemp(prefix=f"{CONTROL_DATA}{host.ns.split('-')[0]}-"))
        os.chmod(self.data, 0o755)  # the system users traverse it
        self.supervisor = Supervisor(os.environ, folder / "logs", say=lambda _: None, cwd=self.data)
        self.rabbitmq = rabbitmq
        self.s3 = s3 and self._s3_available()
        self.s3_server: S3Server | None = None
        self.timings: dict[str, float] = {}

    # -- URLs as every host sees them ----------------------------------------------------------------------
    @property
    def database_url(self) -> str:
        return f"postgresql://postgres@{self.host.address}:{PG_PORT}/{DATABASE}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.host.address}:{REDIS_PORT}/0"

    def amqp_url(self, vhost: str = "/") -> str:
        return f"amqp://guest:guest@{self.host.address}:{AMQP_PORT}/{'' if vhost == '/' else vhost}"

    def artifact_env(self, prefix: str) -> dict[str, str]:
        """The S3 settings of every host (empty without the S3 server: each host then keeps a directory)."""
        return self.s3_server.env(prefix) if self.s3_server is not None else {}

    # -- start ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """All servers at once (RabbitMQ's boot is the long pole), then wait for each to answer."""
        began = time.monotonic()
        if self.rabbitmq:
            self._start_rabbitmq()
        self._start_redis()
        if self.s3:
            self._start_s3()
        self._start_postgres()
        waits = [("redis", REDIS_PORT), ("postgres", PG_PORT)]
        waits += [("rabbitmq", AMQP_PORT)] if self.rabbitmq else []
        waits += [("s3", S3_PORT)] if self.s3 else []
        for name, port in waits:
            wait_for(functools.partial(self._up, port), 90, what=f"{name} on {self.host.address}:{port}", interval=0.1)
            self.timings[name] = time.monotonic() - began
        self._create_database()

    def _up(self, port: int) -> bool:
        self.supervisor.check()
        return listening(self.host.address, port)

    def _start_postgres(self) -> None:
        bin_dir = postgres_bin()
        assert bin_dir is not None
        pgdata = self.data / "pg"
        pgdata.mkdir(mode=0o700)
        _chown_tree(pgdata, "postgres")
        subprocess.run(
            [
                *_as_user("postgres"),
                *(str(bin_dir / "initdb"), "-D", str(pgdata), "-U", "postgres", "--auth=trust", "--encoding=UTF8"),
                *("--no-locale", "--no-sync", "--no-instructions"),
            ],
            check=True,
            capture_output=True,
            timeout=120,
            env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"},
        )
        with open(pgdata / "pg_hba.conf", "a") as hba:  # every host of the bridge, as the machine's trusts loopback
            hba.write(f"host all all {self.host.address}/24 trust\n")
        settings = {
            "listen_addresses": self.host.address,
            "port": str(PG_PORT),
            "unix_socket_directories": str(pgdata),
            "max_connections": "200",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
        }
        options = [arg for key, value in settings.items() for arg in ("-c", f"{key}={value}")]
        argv = [*_as_user("postgres"), str(bin_dir / "postgres"), "-D", str(pgdata), *options]
        self.supervisor.start("postgres", self.host.argv(argv))

    def _create_database(self) -> None:
        import psycopg

        url = f"postgresql://postgres@{self.host.address}:{PG_PORT}/postgres"
        conn = wait_for(lambda: _try_connect(url), 30, what="postgres accepts connections")
        with conn:
            conn.autocommit = True
            conn.execute(f"CREATE DATABASE {DATABASE}")
        assert isinstance(conn, psycopg.Connection)

    def _start_redis(self) -> None:
        folder = self.data / "redis"
        folder.mkdir()
        argv = ["redis-server", "--bind", self.host.address, "--port", str(REDIS_PORT), "--save", ""]
        argv += ["--appendonly", "no", "--protected-mode", "no", "--dir", str(folder)]
        self.supervisor.start("redis", self.host.argv(argv))

    def _start_rabbitmq(self) -> None:
        """RabbitMQ of its own: node, Mnesia, logs, cookie and config under our folder; no plugins (fast boot);
        `guest` allowed from other hosts (it is loopback-only by default)."""
        base = self.data / "rabbitmq"
        (base / "home").mkdir(parents=True)
        cookie = base / "home" / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(16))
        cookie.chmod(0o400)
        (base / "rabbitmq.conf").write_text(
            f"loopback_users = none\nlisteners.tcp.default = {self.host.address}:{AMQP_PORT}\n"
        )
        (base / "enabled_plugins").write_text("[].\n")
        _chown_tree(base, "rabbitmq")
        self.rabbit_env = {
            "HOME": str(base / "home"),
            "RABBITMQ_NODENAME": RABBIT_NODE,
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq"),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(base / "rabbit.pid"),
        }
        argv = [*_as_user("rabbitmq"), "/usr/lib/rabbitmq/bin/rabbitmq-server"]
        self.supervisor.start("rabbitmq", self.host.argv(argv), env=self.rabbit_env)

    def rabbitmqctl(self, *args: str, timeout: float = 60) -> str:
        """`rabbitmqctl -n rabbit@localhost <args>` inside the control namespace, as the rabbitmq user."""
        argv = self.host.argv([*_as_user("rabbitmq"), "/usr/lib/rabbitmq/bin/rabbitmqctl", "-n", RABBIT_NODE, *args])
        result = self.supervisor.run(argv, timeout=timeout, env=self.rabbit_env)
        if result.returncode != 0:
            raise AssertionError(f"rabbitmqctl {' '.join(args)}: {result.stdout}{result.stderr}")
        return result.stdout

    @staticmethod
    def _s3_available() -> bool:
        try:
            import animastor_tasks.dev.s3_server  # noqa: F401  (another change brings it)
        except ImportError:
            return False
        return True

    def _start_s3(self) -> None:
        from animastor_tasks.dev.s3_server import start_s3_server

        self.s3_server = start_s3_server(
            self.data / "s3",
            bucket=S3_BUCKET,
            address=self.host.address,
            port=S3_PORT,
            command_prefix=self.host.argv([]),
            supervisor=self.supervisor,
            timeout=30,
        )

    # -- stop ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self.supervisor.stop_all(grace=5.0)
        finally:
            shutil.rmtree(self.data, ignore_errors=True)


def _try_connect(url: str) -> object:
    import psycopg

    try:
        return psycopg.connect(url, connect_timeout=2)
    except psycopg.OperationalError:
        return None
