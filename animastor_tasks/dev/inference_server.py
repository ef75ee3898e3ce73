"""The reference inference server: the HTTP protocol of docs/inference-protocol.md, stdlib only.

It stands in for a GPU inference service in development and tests: it answers
`POST /v1/generate/audio` with a WAV and `POST /v1/generate/image` with a PNG (from
`animastor_tasks.generators.media`), and can be made slow (`latency`), flaky
(`failure_rate`) or locked (`api_key`) to exercise the client's error handling.

    python -m animastor_tasks.dev.inference_server --port 0   # prints the bound URL first
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import random
import socket
import sys
import time
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from animastor_tasks.generators.media import render_png, synthesize_wav

GENERATE_PREFIX = "/v1/generate/"
MAX_BODY_BYTES = 1024 * 1024
RENDERERS: dict[str, tuple[str, Callable[[str], bytes]]] = {
    "audio": ("audio/wav", synthesize_wav),
    "image": ("image/png", render_png),
}


class InferenceServer(ThreadingHTTPServer):
    """A threading HTTP server carrying the behaviour knobs its handlers read."""

    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        *,
        latency: float = 0.0,
        failure_rate: float = 0.0,
        api_key: str | None = None,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.latency = latency
        self.failure_rate = failure_rate
        self.api_key = api_key or None

    @property
    def url(self) -> str:
        """Base URL of the bound socket (the real port when 0 was asked for)."""
        host, port = self.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{name}]" if ":" in name else name
        return f"http://{shown}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: InferenceServer
    server_version = "animastor-inference/1"

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._json(HTTPStatus.OK, {"status": "ok", "stages": sorted(RENDERERS)})
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route GET {self.path}")

    def do_POST(self) -> None:
        if not self._authorised():
            self._error(HTTPStatus.UNAUTHORIZED, "missing or invalid X-API-Key")
            return
        if not self.path.startswith(GENERATE_PREFIX):
            self._error(HTTPStatus.NOT_FOUND, f"no route POST {self.path}")
            return
        stage = self.path[len(GENERATE_PREFIX) :]
        if stage not in RENDERERS:
            self._error(HTTPStatus.NOT_FOUND, f"unknown stage {stage!r}; this server generates {sorted(RENDERERS)}")
            return
        request = self._read_request(stage)
        if request is None:
            return
        if self.server.latency > 0:
            time.sleep(self.server.latency)
        if self.server.failure_rate > 0 and random.random() < self.server.failure_rate:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "injected failure: the model is overloaded, try again")
            return
        media_type, render = RENDERERS[stage]
        self._send(HTTPStatus.OK, media_type, render(request["input"]))

    def _authorised(self) -> bool:
        expected = self.server.api_key
        if expected is None:
            return True
        given = self.headers.get("X-API-Key", "")
        return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))

    def _read_request(self, stage: str) -> dict[str, Any] | None:
        """Parse and check the JSON body; answer 4xx and return None when it is unusable."""
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
            return None
        try:
            length = int(length_header)
        except ValueError:
            length = -1
        if length < 0:
            self._error(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length_header!r}")
            return None
        if length > MAX_BODY_BYTES:
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes")
            return None
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            self._error(HTTPStatus.BAD_REQUEST, f"body is not valid JSON: {err}")
            return None
        if not isinstance(body, dict):
            self._error(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
            return None
        if not isinstance(body.get("input"), str):
            self._error(HTTPStatus.BAD_REQUEST, "field 'input' is required and must be a string")
            return None
        if "stage" in body and body["stage"] != stage:
            self._error(HTTPStatus.BAD_REQUEST, f"body stage {body['stage']!r} does not match URL stage {stage!r}")
            return None
        if not isinstance(body.get("params", {}), dict):
            self._error(HTTPStatus.BAD_REQUEST, "field 'params' must be an object")
            return None
        return body

    def _json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        self._send(status, "application/json", json.dumps(payload).encode("utf-8"))

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._json(status, {"error": message})

    def _send(self, status: HTTPStatus, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """One line per request on stderr: client, request line, status. Headers (the key) never appear."""
        sys.stderr.write(f"{self.address_string()} {format % args}\n")


def make_server(
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    latency: float = 0.0,
    failure_rate: float = 0.0,
    api_key: str | None = None,
) -> InferenceServer:
    """Bind (port 0 picks a free one) without serving yet; read `server.server_address` or `server.url`."""
    if not latency >= 0:
        raise ValueError(f"latency must be >= 0, got {latency!r}")
    if not 0 <= failure_rate <= 1:
        raise ValueError(f"failure_rate must be between 0 and 1, got {failure_rate!r}")
    return InferenceServer((host, port), latency=latency, failure_rate=failure_rate, api_key=api_key)


def serve(
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    latency: float = 0.0,
    failure_rate: float = 0.0,
    api_key: str | None = None,
) -> None:
    """Serve until interrupted; prints the bound URL as the first stdout line so callers can find it."""
    with make_server(host, port, latency=latency, failure_rate=failure_rate, api_key=api_key) as server:
        print(server.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever(poll_interval=0.2)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: `python -m animastor_tasks.dev.inference_server [--host --port --latency ...]`."""
    parser = argparse.ArgumentParser(prog="animastor_tasks.dev.inference_server", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds to wait before answering a generate call")
    parser.add_argument("--failure-rate", type=float, default=0.0, help="probability (0..1) of answering 503")
    parser.add_argument("--api-key", default=None, help="require this X-API-Key header on POST")
    args = parser.parse_args(argv)
    try:
        serve(args.host, args.port, latency=args.latency, failure_rate=args.failure_rate, api_key=args.api_key)
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
