"""An S3 server's own words (its error's Message) reach logs and the CLI escaped, as an inference server's do: a line
break in them forged a log line, an escape sequence rewrote the operator's terminal (a real HTTP server on loopback
answering as a hostile or broken S3 endpoint; XML carries no ESC)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from animastor_tasks.adapters.s3_artifacts import S3ArtifactStore
from animastor_tasks.errors import ArtifactStoreError

FORGED = "denied\n[GENERATE] book='b' ready\u2028" + "x" * 20_000  # what XML may carry: no ESC


class _Refusing(BaseHTTPRequestHandler):
    def _refuse(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = f"<Error><Code>AccessDenied</Code><Message>{FORGED}</Message></Error>".encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = do_HEAD = do_GET = _refuse

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    for name, value in {
        "AWS_ENDPOINT_URL_S3": url,
        "AWS_ACCESS_KEY_ID": "key",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


def test_an_s3_servers_words_are_escaped_and_cut(refusing_endpoint: str) -> None:
    with pytest.raises(ArtifactStoreError) as refused:
        S3ArtifactStore("bucket", "books").put(b"audio", "audio/wav")
    said = str(refused.value)
    assert "AccessDenied" in said and "denied\\n[GENERATE]" in said and "ready\\u2028" in said, said[:200]
    assert "\n" not in said and "\u2028" not in said
    assert len(said) < 2_000, len(said)
