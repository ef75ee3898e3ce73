"""What the S3 store's upload sends, read off the request boto3 is about to send (nothing is sent)."""

from __future__ import annotations

import base64
import hashlib

import pytest

from animastor_tasks.adapters.s3_artifacts import S3ArtifactStore


class _Sent(Exception):
    """Raised by the hook in place of the send."""


@pytest.mark.parametrize("endpoint", ["https://s3.example.invalid", "http://127.0.0.1:9"])
def test_an_upload_is_one_plain_body_with_its_md5_over_https_as_over_http(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over https boto3 sent the PUT as `aws-chunked` with a trailing checksum (only plain http was tried, by the
    tests' server): S3-compatible servers have refused that encoding, or stored it as the object's."""
    for name, value in {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "key",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    store = S3ArtifactStore("bucket", "books")
    headers: dict[str, str] = {}

    def capture(request: object, **_: object) -> None:
        headers.update({k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})  # type: ignore[attr-defined]
        raise _Sent

    store.client.meta.events.register_first("before-send.s3.PutObject", capture)
    with pytest.raises(_Sent):
        store.probe()
    assert "aws-chunked" not in headers.get("content-encoding", "") and "x-amz-trailer" not in headers, headers
    assert headers["content-md5"] == base64.b64encode(hashlib.md5(b"").digest()).decode()
