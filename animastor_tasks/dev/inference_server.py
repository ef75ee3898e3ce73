"""The reference inference server: the HTTP protocol of docs/inference-protocol.md, stdlib only.

It stands in for a GPU inference service in development and tests: it answers
`POST /v1/generate/audio` with a WAV and `POST /v1/generate/image` with a PNG (from
`animastor_tasks.generators.media`), and the OpenAI-shaped routes many self-hosted GPU
servers expose, `POST /v1/audio/speech` and `POST /v1/images/generations`, with the same
media. It can be made slow (`latency`), flaky (`failure_rate`, `fail_first`, with a
`Retry-After` on the injected 503s) or locked (`api_key`: `X-API-Key` on our routes,
`Authorization: Bearer` on the OpenAI ones) to exercise the clients' error handling.

    python -m animastor_tasks.dev.inference_server --port 0   # prints the bound URL first
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hmac
import json
import random
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from animastor_tasks.generators.media import render_png, synthesize_wav

GENERATE_PREFIX = "/v1/generate/"
SPEECH_ROUTE = "/v1/audio/speech"
IMAGES_ROUTE = "/v1/images/generations"
MAX_BODY_BYTES = 1024 * 1024
MAX_OPENAI_SIDE = 1024  # a bigger PNG takes seconds to draw in pure Python
DEFAULT_OPENAI_SIZE = (64, 64)
_SIZE_RE = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")
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
        fail_first: int = 0,
        retry_after: float | None = None,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.latency = latency
        self.failure_rate = failure_rate
        self.api_key = api_key or None
        self.retry_after = retry_after
        self._fail_left = fail_first
        self._lock = threading.Lock()

    def take_injected_failure(self) -> bool:
        """Whether this generate call answers 503: one of the first `fail_first`, or by `failure_rate`."""
        with self._lock:
            if self._fail_left > 0:
                self._fail_left -= 1
                return True
        return self.failure_rate > 0 and random.random() < self.failure_rate

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
        if self.path in (SPEECH_ROUTE, IMAGES_ROUTE):
            self._openai()
            return
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
        if self._troubled(self._error):
            return
        media_type, render = RENDERERS[stage]
        self._send(HTTPStatus.OK, media_type, render(request["input"]))

    def _troubled(self, error: Callable[..., None]) -> bool:
        """Sleep `latency`, then answer an injected 503 (with Retry-After when set) if one is due."""
        if self.server.latency > 0:
            time.sleep(self.server.latency)
        if not self.server.take_injected_failure():
            return False
        headers = {} if self.server.retry_after is None else {"Retry-After": f"{self.server.retry_after:g}"}
        error(HTTPStatus.SERVICE_UNAVAILABLE, "injected failure: the model is overloaded, try again", headers=headers)
        return True

    def _authorised(self, bearer: bool = False) -> bool:
        expected = self.server.api_key
        if expected is None:
            return True
        if bearer:
            scheme, _, given = self.headers.get("Authorization", "").partition(" ")
            given = given.strip() if scheme.lower() == "bearer" else ""
        else:
            given = self.headers.get("X-API-Key", "")
        return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))

    def _openai(self) -> None:
        """The OpenAI-shaped routes: same media, OpenAI's error shape, Bearer key."""
        if not self._authorised(bearer=True):
            self._openai_error(HTTPStatus.UNAUTHORIZED, "missing or invalid API key (Authorization: Bearer)")
            return
        body = self._read_object(self._openai_error)
        if body is None:
            return
        check = _check_speech if self.path == SPEECH_ROUTE else _check_images
        problem = check(body)
        if problem is not None:
            self._openai_error(HTTPStatus.BAD_REQUEST, problem[1], param=problem[0])
            return
        if self._troubled(self._openai_error):
            return
        if self.path == SPEECH_ROUTE:
            speed = body.get("speed", 1.0)
            self._send(HTTPStatus.OK, "audio/wav", synthesize_wav(body["input"], seconds_per_word=0.12 / speed))
            return
        width, height = _image_size(body.get("size"))
        prompt = body["prompt"]
        images = [
            render_png(prompt if i == 0 else f"{prompt}\n#{i}", width=width, height=height)
            for i in range(body.get("n", 1))
        ]
        data = [{"b64_json": base64.b64encode(png).decode("ascii"), "revised_prompt": prompt} for png in images]
        self._json(HTTPStatus.OK, {"created": int(time.time()), "data": data})

    def _read_request(self, stage: str) -> dict[str, Any] | None:
        """Parse and check the JSON body; answer 4xx and return None when it is unusable."""
        body = self._read_object(self._error)
        if body is None:
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

    def _read_object(self, error: Callable[..., None]) -> dict[str, Any] | None:
        """The body as a JSON object of at most MAX_BODY_BYTES; None once `error` has answered why not."""
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            error(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
            return None
        try:
            length = int(length_header)
        except ValueError:
            length = -1
        if length < 0:
            error(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length_header!r}")
            return None
        if length > MAX_BODY_BYTES:
            error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes")
            return None
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            error(HTTPStatus.BAD_REQUEST, f"body is not valid JSON: {err}")
            return None
        if not isinstance(body, dict):
            error(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
            return None
        return body

    def _json(self, status: HTTPStatus, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._send(status, "application/json", json.dumps(payload).encode("utf-8"), headers)

    def _error(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> None:
        self._json(status, {"error": message}, headers)

    def _openai_error(
        self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None, param: str | None = None
    ) -> None:
        """OpenAI's error shape, which its clients parse: `{"error": {"message", "type", "param", "code"}}`."""
        kind = "server_error" if status >= 500 else "invalid_request_error"
        code = "invalid_api_key" if status == HTTPStatus.UNAUTHORIZED else None
        self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": code}}, headers)

    def _send(self, status: HTTPStatus, content_type: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """One line per request on stderr: client, request line, status. Headers (the key) never appear."""
        sys.stderr.write(f"{self.address_string()} {format % args}\n")


def _text(body: dict[str, Any], key: str, required: bool = True) -> tuple[str, str] | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        return key, f"'{key}' is required and must be a non-empty string"
    return None


def _check_speech(body: dict[str, Any]) -> tuple[str, str] | None:
    """(param, message) of the first problem of a speech request, or None. Only WAV is made here."""
    for key in ("model", "input", "voice"):
        if problem := _text(body, key):
            return problem
    fmt = body.get("response_format", "wav")
    if fmt != "wav":
        return "response_format", f"response_format {fmt!r} is not supported by this server; use 'wav'"
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0.25 <= speed <= 4.0:
        return "speed", f"'speed' must be a number between 0.25 and 4.0, got {speed!r}"
    return None


def _check_images(body: dict[str, Any]) -> tuple[str, str] | None:
    """(param, message) of the first problem of an image request, or None. Only b64_json PNGs are made here."""
    if problem := _text(body, "prompt") or _text(body, "model", required=False):
        return problem
    fmt = body.get("response_format", "b64_json")
    if fmt != "b64_json":
        return "response_format", f"response_format {fmt!r} is not supported by this server; use 'b64_json'"
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4:
        return "n", f"'n' must be an integer between 1 and 4, got {n!r}"
    size = body.get("size")
    if size is not None and size != "auto":
        found = _SIZE_RE.fullmatch(size) if isinstance(size, str) else None
        if found is None or max(int(found[1]), int(found[2])) > MAX_OPENAI_SIDE:
            return "size", f"'size' must be 'WIDTHxHEIGHT' with sides up to {MAX_OPENAI_SIDE}, or 'auto'; got {size!r}"
    return None


def _image_size(size: Any) -> tuple[int, int]:
    found = _SIZE_RE.fullmatch(size) if isinstance(size, str) else None
    return (int(found[1]), int(found[2])) if found else DEFAULT_OPENAI_SIZE


def make_server(
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    latency: float = 0.0,
    failure_rate: float = 0.0,
    api_key: str | None = None,
    fail_first: int = 0,
    retry_after: float | None = None,
) -> InferenceServer:
    """Bind (port 0 picks a free one) without serving yet; read `server.server_address` or `server.url`."""
    if not latency >= 0:
        raise ValueError(f"latency must be >= 0, got {latency!r}")
    if not 0 <= failure_rate <= 1:
        raise ValueError(f"failure_rate must be between 0 and 1, got {failure_rate!r}")
    if fail_first < 0:
        raise ValueError(f"fail_first must be >= 0, got {fail_first!r}")
    if retry_after is not None and not retry_after >= 0:
        raise ValueError(f"retry_after must be >= 0, got {retry_after!r}")
    return InferenceServer(
        (host, port),
        latency=latency,
        failure_rate=failure_rate,
        api_key=api_key,
        fail_first=fail_first,
        retry_after=retry_after,
    )


def serve(server: InferenceServer) -> None:
    """Serve until interrupted; prints the bound URL as the first stdout line so callers can find it."""
    with server:
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
    parser.add_argument("--fail-first", type=int, default=0, help="answer 503 to the first N generate calls")
    parser.add_argument("--retry-after", type=float, default=None, help="send Retry-After: SECONDS with injected 503s")
    parser.add_argument("--api-key", default=None, help="require this key (X-API-Key, or Bearer on OpenAI routes)")
    args = parser.parse_args(argv)
    try:
        server = make_server(
            args.host,
            args.port,
            latency=args.latency,
            failure_rate=args.failure_rate,
            api_key=args.api_key,
            fail_first=args.fail_first,
            retry_after=args.retry_after,
        )
    except ValueError as err:
        parser.error(str(err))
    serve(server)


if __name__ == "__main__":
    main()
