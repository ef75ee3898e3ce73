"""What the transport says of an inference server never holds the endpoint's token nor forges a log line.

*Why:* a job's error goes to asset_states.error, the journal, `status --json`, Flower and the worker's log.
Each server is a real HTTP server on a loopback port, in a thread of this process.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from animastor_tasks.domain.book import printable
from animastor_tasks.errors import GeneratorError
from animastor_tasks.generators import GenerationRequest
from animastor_tasks.generators.transport import Limits, Transport

TOKEN = "s3cretTok"
FORGED = "\n[2025-01-01 00:00:00,000: INFO/MainProcess] [GENERATE] b/ch1/s1 image ready"


def _serve(status: int, body: bytes) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def serve() -> Iterator[Callable[[int, bytes], str]]:
    running: list[Iterator[str]] = []

    def start(status: int, body: bytes) -> str:
        running.append(_serve(status, body))
        return next(running[-1])

    yield start
    for server in running:
        next(server, None)


def _failure(url: str) -> GeneratorError:
    transport = Transport("image", url)
    request = GenerationRequest("b", "ch1", "s1", "image", "Words of the scene.", {})
    limits = Limits(connect_timeout=2, read_timeout=5, total_timeout=10)
    with pytest.raises(GeneratorError) as info:
        transport.post({}, {}, limits, request, lambda: False, lambda _: "image/png")
    assert TOKEN not in transport.shown_url
    return info.value


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_endpoint_s_token_is_not_in_a_connection_error() -> None:
    error = _failure(f"http://127.0.0.1:{_closed_port()}/v1/generate/image?api_key={TOKEN}")
    assert "ConnectionError" in str(error) and TOKEN not in str(error)


def test_an_endpoint_s_token_echoed_by_its_server_is_scrubbed(serve: Callable[[int, bytes], str]) -> None:
    url = serve(401, b'{"error": "key ' + TOKEN.encode() + b' is not valid"}')
    error = _failure(f"{url}/v1/generate/image?access_token={TOKEN}")
    assert "401" in str(error) and TOKEN not in str(error)


@pytest.mark.parametrize(
    "body",
    [
        ('{"error": "model failed' + FORGED.replace("\n", "\\n") + '"}').encode(),  # a JSON error's message
        ("<html>model failed" + FORGED + "\r\n</html>").encode(),  # a page, quoted as it came
        b'{"detail": "bad\\u2028line \\u001b[2J\\u001b]0;pwned\\u0007 \\u202eevil"}',
    ],
)
def test_a_server_s_words_cannot_forge_a_log_line(serve: Callable[[int, bytes], str], body: bytes) -> None:
    said = str(_failure(serve(500, body) + "/v1/generate/image"))
    assert said.isprintable(), said
    assert not any(ch in said for ch in "\n\r\x1b\x07\u2028\u202e")


def test_escaped_words_stay_readable() -> None:
    assert printable("a\nb\r\tc\x1b[2J\u2028d") == "a\\nb\\r\\tc\\x1b[2J\\u2028d"
    assert printable("plain words, é and 漢字") == "plain words, é and 漢字"
