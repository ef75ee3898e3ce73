"""The artifact store on an S3 bucket (AWS or any S3-compatible service), shared by GPU workers on many hosts.

The endpoint, credentials and region come from the standard AWS variables, read by boto3 itself
(AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION).
Keys are content addresses, so an object already there is the same bytes: a HEAD first spares the upload.
Every botocore error leaves as `ArtifactStoreError` carrying the store's own message.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from http.client import HTTPException
from typing import TYPE_CHECKING, Any

import boto3
import urllib3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as EndpointUnreachable

from animastor_tasks.adapters.artifacts import artifact_name
from animastor_tasks.domain.book import printable
from animastor_tasks.errors import ArtifactStoreError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

# Short connect timeout: an endpoint that is down or cut off fails the job in seconds, not minutes;
# "standard" retries (3 attempts, AWS_MAX_ATTEMPTS to change) ride out a brief 5xx or a dropped connection.
# Checksums only where an operation requires one: by default boto3 sends a PUT over https as `aws-chunked` with a
# trailing checksum, which S3-compatible servers have refused or stored encoded; the upload carries a Content-MD5,
# which every S3 checks, instead.
WORDS_LIMIT = 1000  # characters of a server's words an error keeps
_CONFIG = Config(
    connect_timeout=5,
    read_timeout=60,
    retries={"mode": "standard"},
    request_checksum_calculation="when_required",
    response_checksum_validation="when_required",
)


class S3ArtifactStore:
    def __init__(self, bucket: str, prefix: str = "") -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._client: S3Client | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def client(self) -> S3Client:
        """Built at first use (a beat or a CLI that never uploads never builds one); boto3 clients are thread-safe."""
        with self._lock:
            if self._client is None:
                try:
                    client = boto3.session.Session().client("s3", config=_CONFIG)
                except (BotoCoreError, ValueError) as err:
                    raise ArtifactStoreError(self.url, _said(err, named=True)) from err
                client.meta.events.register_first("needs-retry.s3", _retry_only_network_failures)
                self._client = client
            return self._client

    def key(self, digest: str, media_type: str) -> str:
        name = artifact_name(digest, media_type)
        return f"{self.prefix}/{name}" if self.prefix else name

    def put(self, data: bytes, media_type: str) -> dict[str, Any]:
        """Upload the bytes under their sha256 unless an object of that size is there already."""
        digest = hashlib.sha256(data).hexdigest()
        key = self._upload(data, media_type, digest, unless_held=True)
        uri = f"s3://{self.bucket}/{key}"
        return {"sha256": digest, "size": len(data), "media_type": media_type, "path": key, "uri": uri}

    def probe(self) -> None:
        """Upload the empty artifact (its own content address: stored once, harmless) even when it is there: what
        the store answers a PUT, for a GPU worker's start (a HEAD answers a refusal without its reason)."""
        self._upload(b"", "application/octet-stream", hashlib.sha256(b"").hexdigest(), unless_held=False)

    def _upload(self, data: bytes, media_type: str, digest: str, *, unless_held: bool) -> str:
        key = self.key(digest, media_type)
        client = self.client
        try:
            if not (unless_held and self._holds(client, key, len(data))):
                client.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=data,
                    ContentType=media_type,
                    ContentMD5=base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode(),
                    Metadata={"sha256": digest},
                )
        except ClientError as err:
            raise ArtifactStoreError(self.url, _said(err), unreachable=_cannot_serve_now(err)) from err
        except BotoCoreError as err:
            unreachable = isinstance(err, (EndpointUnreachable, HTTPClientError))  # refused, cut off, timed out
            raise ArtifactStoreError(self.url, _said(err, named=True), unreachable=unreachable) from err
        return key

    def _holds(self, client: S3Client, key: str, size: int) -> bool:
        """Whether the object is there with `size` bytes. A HEAD answer carries no message, so any refusal
        (403, 404 of a missing bucket) says "upload": the PUT then fails with the store's own words."""
        try:
            head = client.head_object(Bucket=self.bucket, Key=key)
        except ClientError:
            return False
        return int(head.get("ContentLength", -1)) == size


def _said(err: Exception, *, named: bool = False) -> str:
    """What the S3 server (or boto3) said, cut and escaped (`printable`). *Why:* its words go into logs and onto the
    operator's terminal: a line break in an error's Message forged a log line, and one of 20 KB went whole."""
    text = f"{type(err).__name__}: {err}" if named else str(err)
    return printable(text[:WORDS_LIMIT]) + ("..." if len(text) > WORDS_LIMIT else "")


# What S3 answers when it cannot serve now rather than never (an overloaded or restarting store).
_NOT_NOW = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"})


def _cannot_serve_now(err: ClientError) -> bool:
    status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return status >= 500 or err.response.get("Error", {}).get("Code") in _NOT_NOW


def _retry_only_network_failures(caught_exception: Exception | None = None, **_: Any) -> None:
    """botocore wraps whatever interrupts a request in a retried `HTTPClientError`: the job's soft time limit,
    raised into a hung upload, was retried for minutes (a read timeout a try) until the hard limit killed the
    worker process. An interruption that is no network failure ends the upload with it; the rest retry as set."""
    inner = caught_exception.kwargs.get("error") if isinstance(caught_exception, HTTPClientError) else None
    if inner is not None and not isinstance(inner, (OSError, HTTPException, urllib3.exceptions.HTTPError)):
        raise inner
