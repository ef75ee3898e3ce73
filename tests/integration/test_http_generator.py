"""HttpGenerator against the real reference inference server, run as a subprocess."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests

import animastor_tasks
from animastor_tasks.config import Settings
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.errors import ConfigError, GenerationStopped, GeneratorError
from animastor_tasks.generators import GenerationRequest, Media
from animastor_tasks.generators.http import HttpGenerator
from animastor_tasks.generators.media import png_size, wav_duration_seconds

PACKAGE_PARENT = str(Path(next(iter(animastor_tasks.__path__))).resolve().parent)
SECRET = "s3cr3t-key-do-not-leak"

StartServer = Callable[..., str]


@pytest.fixture(scope="module")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """Start `python -m animastor_tasks.dev.inference_server --port 0 ARGS...` and return its base URL."""
    procs: list[subprocess.Popen[str]] = []
    logs = tmp_path_factory.mktemp("inference-logs")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))}

    def start(*args: str) -> str:
        log_path = logs / f"server-{len(procs)}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "animastor_tasks.dev.inference_server", "--port", "0", *args],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
        procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        line = proc.stdout.readline().strip() if ready else ""
        assert line.startswith("http://127.0.0.1:"), f"server did not start: {line!r} {log_path.read_text()}"
        return line

    yield start
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.fixture(scope="module")
def plain_url(start_server: StartServer) -> str:
    return start_server()


def _spec(url: str, stage: str = "audio", **params: Any) -> StageSpec:
    media_type = {"audio": "audio/wav", "image": "image/png"}.get(stage, "video/mp4")
    return StageSpec(
        name=stage,
        queue=f"gpu.{stage}",
        media_type=media_type,
        input_field="text" if stage == "audio" else "prompt",
        generator="http",
        endpoint=f"{url}/v1/generate/{stage}",
        params=params,
    )


def _request(stage: str = "audio", text: str = "The knight rode into the silent valley.") -> GenerationRequest:
    return GenerationRequest("book-1", "ch-1", "scene-1", stage, text, {})


def _run(spec: StageSpec, key: str = "", request: GenerationRequest | None = None) -> tuple[Media, list[float]]:
    settings = replace(Settings(), inference_api_key=key)
    fractions: list[float] = []
    media = HttpGenerator(spec, settings).generate(request or _request(spec.name), lambda: False, fractions.append)
    return media, fractions


def _fail(spec: StageSpec, key: str = "", request: GenerationRequest | None = None) -> GeneratorError:
    with pytest.raises(GeneratorError) as info:
        _run(spec, key, request)
    assert not isinstance(info.value, GenerationStopped)
    return info.value


def test_audio_round_trips_a_real_wav(plain_url: str) -> None:
    text = " ".join(["word"] * 25)
    media, fractions = _run(_spec(plain_url, "audio"), request=_request("audio", text))
    assert media.media_type == "audio/wav"
    assert wav_duration_seconds(media.data) == pytest.approx(25 * 0.12)
    assert fractions[-1] == 1.0


def test_image_round_trips_a_real_png(plain_url: str) -> None:
    first, _ = _run(_spec(plain_url, "image"), request=_request("image", "a lighthouse in fog"))
    again, _ = _run(_spec(plain_url, "image"), request=_request("image", "a lighthouse in fog"))
    other, _ = _run(_spec(plain_url, "image"), request=_request("image", "a lighthouse at noon"))
    assert first.media_type == "image/png"
    assert png_size(first.data) == (64, 64)
    assert first.data == again.data != other.data


def test_healthz_answers(plain_url: str) -> None:
    with requests.get(f"{plain_url}/healthz", timeout=5) as response:
        assert response.status_code == 200
        assert response.json()["status"] == "ok"


def test_unknown_stage_is_a_non_retryable_404(plain_url: str) -> None:
    err = _fail(_spec(plain_url, "video"))
    assert err.retryable is False
    assert "404" in str(err)
    assert "unknown stage 'video'" in str(err)


def test_bad_request_body_is_rejected_with_a_clear_error(plain_url: str) -> None:
    with requests.post(f"{plain_url}/v1/generate/audio", data=b"{not json", timeout=5) as response:
        assert response.status_code == 400
        assert "not valid JSON" in response.json()["error"]
    with requests.post(f"{plain_url}/v1/generate/audio", json={"stage": "audio"}, timeout=5) as response:
        assert response.status_code == 400
        assert "'input'" in response.json()["error"]


def test_api_key_is_required_when_the_server_has_one(start_server: StartServer) -> None:
    url = start_server("--api-key", SECRET)
    media, _ = _run(_spec(url, "audio"), key=SECRET)
    assert wav_duration_seconds(media.data) > 0
    for key in ("wrong-key-123", ""):
        err = _fail(_spec(url, "audio"), key=key)
        assert err.retryable is False
        assert "401" in str(err)
        assert "missing or invalid X-API-Key" in str(err)  # the server's own message
        if key:
            assert key not in str(err)


def test_server_failure_is_retryable_and_never_shows_the_key(start_server: StartServer) -> None:
    url = start_server("--failure-rate", "1", "--api-key", SECRET)
    err = _fail(_spec(url, "audio"), key=SECRET)
    assert err.retryable is True
    assert "503" in str(err)
    assert "injected failure" in str(err)
    assert SECRET not in str(err)


def test_read_timeout_is_retryable(start_server: StartServer) -> None:
    url = start_server("--latency", "3")
    started = time.monotonic()
    err = _fail(_spec(url, "audio", read_timeout=0.3))
    assert err.retryable is True
    assert "Timeout" in str(err)
    assert time.monotonic() - started < 2.5


def test_closed_port_is_a_quick_retryable_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    err = _fail(_spec(f"http://127.0.0.1:{port}", "audio"))
    assert err.retryable is True
    assert time.monotonic() - started < 2.0


def test_stop_before_the_request_sends_nothing() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    generator = HttpGenerator(_spec(f"http://127.0.0.1:{port}", "audio"), Settings())
    with pytest.raises(GenerationStopped):
        generator.generate(_request(), lambda: True, lambda _: None)


def test_spec_without_endpoint_is_a_config_error() -> None:
    spec = StageSpec(name="audio", queue="gpu.audio", media_type="audio/wav", generator="http")
    with pytest.raises(ConfigError, match=r"'audio'.*endpoint"):
        HttpGenerator(spec, Settings())


class _RedirectHandler(BaseHTTPRequestHandler):
    """Answers every POST with a redirect, counting the requests it gets."""

    hits: list[str] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        type(self).hits.append(self.path)
        body = json.dumps({"error": "moved"}).encode()
        self.send_response(302)
        self.send_header("Location", "http://elsewhere.example:9/v1/generate/audio")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def redirect_url() -> Iterator[str]:
    _RedirectHandler.hits = []
    server = HTTPServer(("127.0.0.1", 0), _RedirectHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_redirect_is_refused_not_followed(redirect_url: str) -> None:
    err = _fail(_spec(redirect_url, "audio"), key=SECRET)
    assert err.retryable is False
    assert "302" in str(err)
    assert "'elsewhere.example'" in str(err)
    assert SECRET not in str(err)
    assert _RedirectHandler.hits == ["/v1/generate/audio"]  # one request, to the configured URL only
