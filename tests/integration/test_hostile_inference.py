"""Generators against inference servers that misbehave the ways third-party ones do: a body that trickles in,
media that is broken or empty under the right Content-Type, a `~/.netrc` on the worker host.

Each server is a real HTTP server on a loopback port, in a thread of this process, scripted per test.
"""

from __future__ import annotations

import base64
import contextlib
import select
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from animastor_tasks.config import Settings
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.errors import ConfigError, GenerationStopped, GeneratorError
from animastor_tasks.generators import GenerationRequest, Media
from animastor_tasks.generators.http import HttpGenerator
from animastor_tasks.generators.media import render_png, synthesize_wav
from animastor_tasks.generators.openai_images import OpenAIImagesGenerator
from animastor_tasks.generators.openai_speech import OpenAISpeechGenerator
from tests.support import missing
from tests.unit.test_audio_frames import mp3_stream, ogg_stream

Answer = Callable[[BaseHTTPRequestHandler], None]
SECRET = "sk-hostile-test-key"


class _Handler(BaseHTTPRequestHandler):
    answer: Answer
    seen: list[dict[str, str]]

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        type(self).seen.append(dict(self.headers))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up, as it should have
            type(self).answer(self)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def tls_certificate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed certificate for 127.0.0.1 (its key beside it), made with the openssl command."""
    if shutil.which("openssl") is None:
        missing("the openssl command is not installed (apt-get install -y openssl)")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert


@pytest.fixture
def serve_tls(
    serve: Callable[..., str], tls_certificate: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[Answer], str]:
    """`serve_tls(answer)`: as `serve`, over HTTPS, with its certificate trusted by requests."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls_certificate))
    return lambda answer: serve(answer, tls=tls_certificate)


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """`serve(answer)`: the base URL of a server answering every POST with `answer(handler)`."""
    servers: list[tuple[ThreadingHTTPServer, threading.Thread]] = []

    def start(answer: Answer, tls: Path | None = None) -> str:
        handler = type("Handler", (_Handler,), {"answer": staticmethod(answer), "seen": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls, tls.with_name("key.pem"))
            server.socket = context.wrap_socket(server.socket, server_side=True)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        servers.append((server, thread))
        start.seen = handler.seen  # type: ignore[attr-defined]
        return f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def answering(
    status: int, media_type: str, body: bytes, *, length: int | None = None, headers: dict[str, str] | None = None
) -> Answer:
    """An answer of `status` with `body` (and its length, or `length`), and `headers` besides."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", media_type)
        handler.send_header("Content-Length", str(len(body) if length is None else length))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(body)

    return answer


def _trickle(every: float, total: int = 200) -> Answer:
    """A 200 whose body comes one byte at a time, each well within any read timeout."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "audio/wav")
        handler.send_header("Content-Length", str(total))
        handler.end_headers()
        for _ in range(total):
            handler.wfile.write(b"\0")
            handler.wfile.flush()
            time.sleep(every)

    return answer


def _spec(url: str, stage: str = "audio", generator: str = "http", **params: Any) -> StageSpec:
    media_type = {"audio": "audio/wav", "image": "image/png"}[stage]
    path = "/v1" if generator.startswith("openai") else f"/v1/generate/{stage}"
    return StageSpec(stage, f"gpu.{stage}", "text" if stage == "audio" else "prompt", media_type,
                     generator=generator, endpoint=url + path, params=params)  # fmt: skip


def _generate(spec: StageSpec, *, key: str = "", stop: Callable[[], bool] = lambda: False) -> Media:
    settings = replace(Settings(), inference_api_key=key)
    kinds = {"openai-speech": OpenAISpeechGenerator, "openai-images": OpenAIImagesGenerator}
    kind = kinds.get(spec.generator, HttpGenerator)
    request = GenerationRequest("b", "ch1", "s1", spec.name, "Words of the scene.", {})
    return kind(spec, settings).generate(request, stop, lambda _: None)


def test_a_trickling_body_is_left_as_soon_as_the_job_is_told_to_stop(serve: Callable[[Answer], str]) -> None:
    """The body was read 64 KiB at a time, and a read waits for its whole chunk: a byte every 50 ms kept the job
    (and its GPU slot) past a cancel until the body ended, 10 s here, however long the server went on."""
    url = serve(_trickle(0.05))
    started = time.monotonic()
    with pytest.raises(GenerationStopped):
        _generate(_spec(url, read_timeout=5), stop=lambda: time.monotonic() > started + 0.3)
    assert time.monotonic() - started < 2.0


def test_a_trickle_past_the_whole_answers_deadline_is_a_retryable_error(serve: Callable[[Answer], str]) -> None:
    """Each byte reset the read timeout: a server sending one every 50 ms held the job as long as it liked."""
    url = serve(_trickle(0.05))
    started = time.monotonic()
    with pytest.raises(GeneratorError) as info:
        _generate(_spec(url, read_timeout=0.5, total_timeout=1))
    assert info.value.retryable and "total_timeout" in str(info.value)
    assert time.monotonic() - started < 3.0


@pytest.fixture
def unanswered_connects() -> Iterator[str]:
    """The URL of a listener whose accept queue is full: the kernel drops further SYNs, so a connect to it waits
    as one to a host that drops them does (a firewall, a GPU box gone from the network)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        fillers = [socket.socket() for _ in range(4)]
        for filler in fillers:
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(listener.getsockname())
        time.sleep(0.2)
        try:
            yield f"http://127.0.0.1:{listener.getsockname()[1]}"
        finally:
            for filler in fillers:
                filler.close()


@pytest.fixture
def stalled_handshakes() -> Iterator[str]:
    """The https URL of a listener that takes connections and never says a word: a TLS handshake with it waits on
    (a server hung before its TLS layer, a load balancer whose backend is gone)."""
    taken: list[socket.socket] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)

        def take() -> None:
            with contextlib.suppress(OSError):  # the listener closed: the test is over
                while True:
                    taken.append(listener.accept()[0])

        threading.Thread(target=take, daemon=True).start()
        try:
            yield f"https://127.0.0.1:{listener.getsockname()[1]}"
        finally:
            for conn in taken:
                conn.close()


@pytest.mark.parametrize("server", ["unanswered_connects", "stalled_handshakes"])
def test_a_connect_or_tls_handshake_in_progress_is_cut_by_a_stop_and_by_the_whole_answers_deadline(
    server: str, request: pytest.FixtureRequest
) -> None:
    """The watchdog took the socket only once it had connected: a stopped job (and its GPU slot) waited out
    `connect_timeout`, once per address its host resolves to, before it saw the stop; so did `total_timeout`. Over
    TLS it held the TCP socket, which TLS detaches before its handshake, and got the TLS socket only once the handshake
    was done: a stopped job waited out `connect_timeout` (up to 600 s) on a server that never answered it."""
    url = request.getfixturevalue(server)
    started = time.monotonic()
    with pytest.raises(GenerationStopped):
        _generate(_spec(url, connect_timeout=8), stop=lambda: time.monotonic() > started + 0.3)
    assert time.monotonic() - started < 1.5
    started = time.monotonic()
    with pytest.raises(GeneratorError) as info:
        _generate(_spec(url, connect_timeout=8, total_timeout=0.5))
    assert info.value.retryable and "total_timeout" in str(info.value), info.value
    assert time.monotonic() - started < 1.5


def _server(request: pytest.FixtureRequest, scheme: str) -> Callable[[Answer], str]:
    return request.getfixturevalue("serve_tls" if scheme == "https" else "serve")


def _computing(seconds: float, left: list[float]) -> Answer:
    """A server still computing for `seconds` before its answer begins; it notes when its client went away (a
    server that drops the work of a closed connection frees its GPU then), and answers if it is still there."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        conn: socket.socket = handler.connection
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            readable, _, _ = select.select([conn], [], [], 0.02)
            if readable and socket.socket.recv(conn, 1, socket.MSG_PEEK) == b"":  # under TLS too
                left.append(time.monotonic())
                return
        answering(200, "audio/wav", synthesize_wav("one two"))(handler)

    return answer


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_server_still_computing_is_left_as_soon_as_the_job_is_told_to_stop(
    scheme: str, request: pytest.FixtureRequest
) -> None:
    """No byte of the answer had come, so nothing checked the stop: a cancelled job (and its GPU slot) waited for
    the server to finish, up to `read_timeout` (300 s by default), and the server computed on for nobody. Over
    HTTPS the watchdog held the TCP socket that TLS had taken over, and its cut did nothing."""
    left: list[float] = []
    url = _server(request, scheme)(_computing(6.0, left))
    started = time.monotonic()
    with pytest.raises(GenerationStopped):
        _generate(_spec(url, read_timeout=10), stop=lambda: time.monotonic() > started + 0.3)
    assert time.monotonic() - started < 2.0
    wait_for = time.monotonic() + 3.0
    while not left and time.monotonic() < wait_for:
        time.sleep(0.02)
    assert left and left[0] - started < 2.0, "the server never saw its client go"


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_headers_trickling_past_the_whole_answers_deadline_are_a_retryable_error(
    scheme: str, request: pytest.FixtureRequest
) -> None:
    """`total_timeout` was checked only as the body arrived: a server sending its headers a byte every 50 ms, each
    within the read timeout, held the job for as long as it went on."""

    def trickle_headers(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        for byte in b"X-Pad: " + b"x" * 160:  # 8 s of one header line
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(0.05)

    url = _server(request, scheme)(trickle_headers)
    started = time.monotonic()
    with pytest.raises(GeneratorError) as info:
        _generate(_spec(url, read_timeout=0.5, total_timeout=1))
    assert info.value.retryable and "total_timeout" in str(info.value)
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize(
    ("stage", "body", "why"),
    [
        ("audio", synthesize_wav("one two")[:44], "a WAV header with no samples (a TTS given only punctuation)"),
        ("audio", synthesize_wav("one two three four")[:-2000], "a WAV cut short"),
        ("audio", b'{"error": "CUDA out of memory"}', "a JSON error sent as audio/wav"),
        ("image", render_png("a lighthouse")[:-20], "a PNG still being written"),
    ],
)
def test_broken_media_under_the_right_content_type_is_not_a_result(
    serve: Callable[[Answer], str], stage: str, body: bytes, why: str
) -> None:
    """The http generator checked the Content-Type and that the body was not empty: each of these was stored and
    the pair marked ready, so nothing ever made it again."""
    url = serve(answering(200, {"audio": "audio/wav", "image": "image/png"}[stage], body))
    with pytest.raises(GeneratorError) as info:
        _generate(_spec(url, stage))
    assert not isinstance(info.value, GenerationStopped), why


def _close_delimited(media_type: str, body: bytes) -> Answer:
    """A 200 with no Content-Length (HTTP/1.0: the body ends when the server closes the connection)."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.protocol_version = "HTTP/1.0"
        handler.send_response(200)
        handler.send_header("Content-Type", media_type)
        handler.end_headers()
        handler.wfile.write(body)
        handler.close_connection = True

    return answer


@pytest.mark.parametrize(
    ("media_type", "whole"),
    [
        ("image/jpeg", b"\xff\xd8\xff\xe0" + bytes(200) + b"\xff\xda" + bytes(300) + b"\xff\xd9"),
        (
            "image/webp",
            b"RIFF" + (4 + 8 + 500).to_bytes(4, "little") + b"WEBPVP8L" + (500).to_bytes(4, "little") + bytes(500),
        ),
    ],
)
def test_a_close_delimited_image_whose_connection_dropped_is_not_a_result(
    serve: Callable[[Answer], str], media_type: str, whole: bytes
) -> None:
    """Without a length, a body cut short by a dropped connection reads as a whole one: the stage stored half an
    image and marked the pair ready. The whole one is taken; the cut one fails the attempt, worth another one."""
    spec = replace(_spec(serve(_close_delimited(media_type, whole)), "image"), media_type=media_type)
    assert _generate(spec).data == whole
    spec = replace(spec, endpoint=serve(_close_delimited(media_type, whole[: len(whole) // 2])) + "/v1/generate/image")
    with pytest.raises(GeneratorError, match="cut short") as info:
        _generate(spec)
    assert info.value.retryable and not info.value.misconfigured, info.value


@pytest.mark.parametrize("generator", ["openai-speech", "http"])
@pytest.mark.parametrize(
    ("media_type", "whole"), [("audio/mpeg", mp3_stream(12)), ("audio/ogg", ogg_stream())], ids=["mp3", "ogg"]
)
def test_close_delimited_audio_whose_connection_dropped_is_not_a_result(
    serve: Callable[[Answer], str], generator: str, media_type: str, whole: bytes
) -> None:
    """MP3 (OpenAI's default response_format), AAC and Ogg answers were taken as they came: one whose connection
    dropped halfway was stored as the scene's audio. The whole one is taken; the cut one fails the attempt. A
    dropped connection is the backend's, not the scene's: taken as the scene's verdict, it failed the pair for good."""
    params = {"model": "tts"} if generator == "openai-speech" else {}

    def spec_for(body: bytes) -> StageSpec:
        return replace(
            _spec(serve(_close_delimited(media_type, body)), generator=generator, **params), media_type=media_type
        )

    assert _generate(spec_for(whole), key=SECRET).data == whole
    with pytest.raises(GeneratorError, match="cut short") as info:
        _generate(spec_for(whole[: len(whole) // 2]), key=SECRET)
    assert info.value.retryable and not info.value.misconfigured, info.value


@pytest.mark.parametrize("generator", ["openai-speech", "http"])
def test_a_close_delimited_wav_whose_connection_dropped_is_worth_another_attempt(
    serve: Callable[[Answer], str], generator: str
) -> None:
    """A server OOM-killed halfway through a body without a length: the WAV's own length tells the cut, which was
    taken as the scene's verdict (the pair failed for good) where the same request may well succeed again."""
    whole = synthesize_wav("one two three four")
    params = {"model": "tts"} if generator == "openai-speech" else {}
    for body in (whole[: len(whole) // 2], whole[:30]):  # in the samples, in the header
        with pytest.raises(GeneratorError, match="cut short") as info:
            _generate(_spec(serve(_close_delimited("audio/wav", body)), generator=generator, **params), key=SECRET)
        assert info.value.retryable and not info.value.misconfigured, info.value


def test_an_empty_body_is_never_the_scenes_verdict(serve: Callable[[Answer], str]) -> None:
    """Headers, then a closed connection (a server that died right after them), or a `Content-Length: 0` (a server
    whose model broke answers so to whatever it is sent): the empty body was the scene's verdict, failed for good."""
    for answer in (_close_delimited("audio/wav", b""), answering(200, "audio/wav", b"")):
        with pytest.raises(GeneratorError, match="empty body") as info:
            _generate(_spec(serve(answer)))
        assert info.value.retryable and not info.value.misconfigured, info.value


def test_an_images_answer_cut_short_is_worth_another_attempt_and_one_of_no_json_is_not(
    serve: Callable[[Answer], str],
) -> None:
    """JSON cut by a dropped connection (no length) was taken as a server that does not answer JSON: misconfigured,
    the pair failed for good and the breaker counted a setting where the connection was at fault."""
    whole = b'{"data": [{"b64_json": "%s"}]}' % base64.b64encode(render_png("a tower"))
    for cut in (whole[:40], whole[:-3], whole[:9]):
        url = serve(_close_delimited("application/json", cut))
        with pytest.raises(GeneratorError) as info:
            _generate(_spec(url, "image", "openai-images", model="img"), key=SECRET)
        assert info.value.retryable and not info.value.misconfigured and "cut short" in str(info.value), info.value
    not_json = _images(b"<html>Sign in</html>", serve)
    assert not_json.misconfigured and not not_json.retryable, not_json


def test_a_header_only_wav_from_an_openai_server_is_not_a_result(serve: Callable[[Answer], str]) -> None:
    url = serve(answering(200, "audio/wav", synthesize_wav("one")[:44]))
    with pytest.raises(GeneratorError, match="WAV"):
        _generate(_spec(url, generator="openai-speech", model="tts"), key=SECRET)


@pytest.mark.parametrize("generator", ["openai-speech", "http"])
def test_an_error_text_under_the_media_type_is_the_servers_and_a_wav_with_no_samples_the_scenes(
    serve: Callable[[Answer], str], generator: str
) -> None:
    """A body with no WAV signature at all (a broken model's error text under `audio/wav`) failed the scene for good,
    as a WAV with no samples (a TTS given only punctuation) does: it is the server's answer to whatever it is sent,
    retried and counted by the breaker. A WAV of the right shape with no samples stays the scene's verdict."""
    params = {"model": "tts"} if generator == "openai-speech" else {}
    error_text = answering(200, "audio/wav", b"RuntimeError: CUDA error: out of memory")
    with pytest.raises(GeneratorError, match="not a WAV file: no RIFF/WAVE header") as info:
        _generate(_spec(serve(error_text), generator=generator, **params), key=SECRET)
    assert info.value.retryable and not info.value.misconfigured, info.value
    silent = answering(200, "audio/wav", synthesize_wav("one")[:40] + bytes(4))  # its data chunk: 0 bytes
    with pytest.raises(GeneratorError, match="no samples") as info:
        _generate(_spec(serve(silent), generator=generator, **params), key=SECRET)
    assert not info.value.retryable and not info.value.misconfigured, info.value


def test_retry_after_of_a_refusal_travels_with_the_error(serve: Callable[[Answer], str]) -> None:
    """The http generator never reads Retry-After itself: the worker's backoff now can, from the error."""

    with pytest.raises(GeneratorError) as info:
        _generate(_spec(serve(answering(429, "text/plain", b"", headers={"Retry-After": "7"}))))
    assert info.value.retryable and info.value.retry_after == 7.0
    assert info.value.rate_limited  # 429: whoever asks is refused, not this scene


@pytest.mark.parametrize("generator", ["http", "openai-speech"])
def test_a_param_no_json_body_can_carry_is_the_stages_setting_and_nothing_is_sent(
    serve: Callable[[Answer], str], generator: str
) -> None:
    """A NaN or an infinity among the params (a plugin's, a job's) made requests refuse the body: retried as a
    backend fault, the server never asked. It is the stage's setting, the same for every scene: misconfigured."""
    url = serve(answering(200, "audio/wav", synthesize_wav("one two")))
    seen: list[dict[str, str]] = serve.seen  # type: ignore[attr-defined]
    with pytest.raises(GeneratorError, match="InvalidJSONError") as info:
        _generate(_spec(url, generator=generator, model="tts", speed=float("nan")), key=SECRET)
    assert info.value.misconfigured and not info.value.retryable, info.value
    assert seen == []


def test_netrc_credentials_on_the_worker_host_are_never_sent(
    serve: Callable[[Answer], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """requests reads ~/.netrc for a call without `auth`: a `default` entry, meant for another service, went in
    clear to the inference server, and replaced the OpenAI generators' Bearer key (every call a 401)."""
    netrc = tmp_path / "netrc"
    netrc.write_text("default login someone password elsewhere-secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    url = serve(answering(200, "audio/wav", synthesize_wav("one two")))
    seen: list[dict[str, str]] = serve.seen  # type: ignore[attr-defined]
    _generate(_spec(url))
    _generate(_spec(url, generator="openai-speech", model="tts"), key=SECRET)
    authorizations = [headers.get("Authorization") for headers in seen]
    assert authorizations == [None, f"Bearer {SECRET}"]


@pytest.mark.parametrize(
    ("status", "media_type", "misconfigured"),
    [
        (401, "application/json", True),  # a key rotated away
        (404, "application/json", True),  # a route gone
        (405, "text/html", True),
        (200, "text/html", True),  # a web page where media was due: another server answers there
        # The body's or the answer's format, or the protocol, refused: the same for every scene.
        (406, "application/json", True),
        (415, "application/json", True),
        (426, "application/json", True),
        (400, "application/json", False),  # this scene's input refused: a verdict on the scene
        (413, "application/json", False),
        # Another success than the protocol's 200 (an API that creates, queues or answers nothing) was a verdict on
        # each scene in turn: every pair of the lane failed at full speed, the breaker told nothing.
        (201, "audio/wav", True),
        (202, "application/json", True),
    ],
)
def test_a_refusal_of_every_request_is_told_apart_from_a_refusal_of_the_scene(
    serve: Callable[[Answer], str], status: int, media_type: str, misconfigured: bool
) -> None:
    url = serve(answering(status, media_type, b'{"error": "no"}'))
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(url))
    assert (caught.value.misconfigured, caught.value.retryable) == (misconfigured, False)


def test_another_success_than_200_does_not_quote_its_media_as_the_error(serve: Callable[[Answer], str]) -> None:
    url = serve(answering(201, "audio/wav", synthesize_wav("one two")))
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(url))
    assert "answered 201" in str(caught.value) and "RIFF" not in str(caught.value), caught.value


def test_a_redirect_to_a_malformed_location_is_a_misconfigured_endpoint_not_a_bug(
    serve: Callable[[Answer], str],
) -> None:
    """`Location: http://[gpu-box/v1` raised urllib's ValueError from the check itself: counted as a generator bug,
    the pair failed with a traceback, the breaker told nothing, the redirect never named."""

    moved = answering(302, "text/plain", b"", headers={"Location": "http://[gpu-box/v1"})
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(serve(moved)))
    assert caught.value.misconfigured and "a redirect to a Location that cannot be read" in str(caught.value)


def test_a_redirect_to_a_host_named_after_the_key_does_not_store_the_key(serve: Callable[[Answer], str]) -> None:
    """Old code: the redirect's host was quoted as it came, lower-cased by the URL parser, past the scrub of the key
    (which matched its case only): `... redirecting to host 'sk-hostile-test-key.evil.example'` was stored."""

    def key_echoed(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", f"http://{handler.headers['X-API-Key'].upper()}.evil.example/")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(serve(key_echoed)), key=SECRET)
    assert caught.value.misconfigured and "redirecting to host" in str(caught.value)
    assert SECRET not in str(caught.value).lower() and "***.evil.example" in str(caught.value), caught.value


def _images(body: bytes, url_of: Callable[[Answer], str]) -> GeneratorError:
    with pytest.raises(GeneratorError) as caught:
        _generate(
            _spec(url_of(answering(200, "application/json", body)), "image", "openai-images", model="img"), key=SECRET
        )
    return caught.value


def test_an_images_server_that_answers_every_request_in_another_shape_is_misconfigured(
    serve: Callable[[Answer], str],
) -> None:
    """A server that ignores `response_format` (a URL where the base64 image was asked for), or makes another image
    type than the stage stores, answers every scene so: each was failed as the scene's own verdict, the whole lane
    at full speed, and its breaker told nothing."""
    as_url = _images(b'{"data": [{"url": "http://images.example/1.png"}]}', serve)
    assert as_url.misconfigured and "data[0].b64_json" in str(as_url), as_url
    jpeg = base64.b64encode(b"\xff\xd8\xff\xe0" + bytes(64)).decode()
    other_type = _images(f'{{"data": [{{"b64_json": "{jpeg}"}}]}}'.encode(), serve)
    assert other_type.misconfigured and "'image/jpeg'" in str(other_type), other_type


def test_an_error_answered_under_200_is_retried_with_the_server_s_words(serve: Callable[[Answer], str]) -> None:
    """`200 {"error": {"message": "model is loading"}}` failed the scene for good, the server's words lost."""
    loading = _images(b'{"error": {"message": "model is loading, try again", "type": "server_error"}}', serve)
    assert loading.retryable and not loading.misconfigured, loading
    assert "model is loading, try again" in str(loading), loading


def test_a_speech_server_that_ignores_the_format_asked_for_is_misconfigured(serve: Callable[[Answer], str]) -> None:
    """An MP3 answered for a WAV stage (the server ignores `response_format`) is its answer to every scene."""
    url = serve(answering(200, "audio/mpeg", mp3_stream()))
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(url, generator="openai-speech", model="tts"), key=SECRET)
    assert caught.value.misconfigured and "audio/mpeg" in str(caught.value), caught.value


def test_a_body_declared_larger_than_max_bytes_is_refused_before_it_is_read(serve: Callable[[Answer], str]) -> None:
    """The declared length was not looked at: the body was read up to `max_bytes` (here it trickles, so the job sat
    on its slot until a timeout, and the error was a retryable read failure), held twice in memory at the end."""

    def huge(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "audio/wav")
        handler.send_header("Content-Length", str(10_000_000))
        handler.end_headers()
        handler.wfile.write(synthesize_wav("one")[:64])
        handler.wfile.flush()
        time.sleep(3)

    started = time.monotonic()
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(serve(huge), max_bytes=1_000_000, read_timeout=2))
    assert time.monotonic() - started < 1.0
    assert "exceeds max_bytes=1000000" in str(caught.value) and not caught.value.retryable, caught.value


def test_an_endpoint_no_request_can_reach_is_misconfigured_not_a_verdict_on_each_scene() -> None:
    """A port out of range (`check_endpoint` let it through) raised InvalidURL for every request: each pair of the
    lane failed for good as if its scene were at fault, and the breaker heard nothing."""
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec("http://127.0.0.1:99999"))
    assert caught.value.misconfigured and not caught.value.retryable, caught.value


def test_an_endpoint_whose_host_has_an_empty_label_is_misconfigured_not_a_bug() -> None:
    """`gpu..box` passed the endpoint check and urllib3's LocationParseError (a ValueError) escaped the transport:
    a generator bug on every job, each pair of the lane failed for good, the breaker told nothing."""
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec("http://gpu..box:9/x"))
    assert caught.value.misconfigured and not caught.value.retryable, caught.value


@pytest.mark.parametrize(
    ("status", "stage", "generator"), [(400, "audio", "http"), (200, "audio", "http"), (200, "image", "openai-images")]
)
def test_a_json_body_nested_past_the_parsers_depth_is_the_servers_answer_not_a_bug(
    serve: Callable[[Answer], str], status: int, stage: str, generator: str
) -> None:
    """`json.loads` raises RecursionError on 5,000 nested brackets (well inside the 64 KiB read of an error body):
    it escaped the transport as a generator bug, and the breaker heard nothing of the server's answer."""
    url = serve(answering(status, "application/json", b"[" * 5000))
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(url, stage, generator, model="m"), key=SECRET)
    assert "inference endpoint" in str(caught.value), caught.value


def test_a_stop_cuts_the_connect_of_a_host_with_two_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connect in progress was cut, then the name's next address was tried: its socket, shut down before it
    connected, still connected, and the stopped job waited out that address's whole connect_timeout (4.3 s)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = [socket.socket() for _ in range(4)]  # the accept queue full: further SYNs are dropped
    for filler in fillers:
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(listener.getsockname())
    time.sleep(0.2)
    port, real = listener.getsockname()[1], socket.getaddrinfo

    def two_addresses(host: str, *args: Any, **kwargs: Any) -> Any:
        found = real("127.0.0.1" if host == "gpu.example" else host, *args, **kwargs)
        return found[:1] * 2 if host == "gpu.example" else found

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    started = time.monotonic()
    try:
        with pytest.raises(GenerationStopped):
            _generate(
                _spec(f"http://gpu.example:{port}", connect_timeout=4), stop=lambda: time.monotonic() > started + 0.3
            )
    finally:
        for sock in (listener, *fillers):
            sock.close()
    assert time.monotonic() - started < 1.5


def test_an_endpoint_with_a_login_in_its_url_is_refused_as_a_setting() -> None:
    """The login was never sent (the request's only credential is the worker's key): every scene answered 401."""
    with pytest.raises(ConfigError, match="carries a login") as caught:
        _generate(_spec("http://alice:pa55word@127.0.0.1:9"))
    assert "pa55word" not in str(caught.value)


def test_a_key_echoed_in_the_servers_own_json_escapes_is_scrubbed(serve: Callable[[Answer], str]) -> None:
    """An error body of another shape was quoted as sent: a server that escapes `<`, `>`, `&` or `/` in JSON (Go,
    PHP) echoed the key past the scrub, into the journal."""
    key = "sk-ab<cd>&ef/gh"
    escaped = key.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("/", "\\/")
    url = serve(answering(401, "application/json", ('{"message": "invalid key ' + escaped + '"}').encode()))
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(url), key=key)
    message = str(caught.value)
    assert "invalid key ***" in message, message
    assert "sk-ab" not in message and "gh" not in message and "u003c" not in message, message


@pytest.mark.parametrize("interim", [102, 103])
def test_an_interim_status_before_the_answer_is_a_misconfigured_endpoint_not_a_verdict(
    serve: Callable[[Answer], str], interim: int
) -> None:
    """requests skips only a 100: a 102 or 103 before the 200 was taken for the answer, its empty body a verdict
    on each scene in turn (every pair of the lane failed, the breaker told nothing)."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        wav = synthesize_wav("one two")
        handler.wfile.write(f"HTTP/1.1 {interim} Interim\r\n\r\n".encode())
        handler.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: audio/wav\r\nContent-Length: " + str(len(wav)).encode() + b"\r\n\r\n"
        )
        handler.wfile.write(wav)

    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(serve(answer)))
    assert caught.value.misconfigured and f"answered {interim}" in str(caught.value), caught.value


def _declaring(length: bytes, body: bytes) -> Answer:
    """A 200 whose Content-Length is `length` as sent, then `body`, then a closed connection."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: audio/wav\r\nContent-Length: " + length + b"\r\nConnection: close\r\n"
        handler.wfile.write(head + b"\r\n" + body)
        handler.close_connection = True

    return answer


@pytest.mark.parametrize("length", [b"\xb2", b"1\xb9", b"9" * 5000, b"0" * 5000])
def test_a_content_length_python_reads_as_a_number_but_is_none_is_not_a_bug(
    serve: Callable[[Answer], str], length: bytes
) -> None:
    """`²` (latin-1, as headers are read) passes `str.isdigit` and fails `int`, and 5,000 digits pass it and exceed
    `int`'s digit limit: a ValueError from the generator, a bug, and every scene of the lane failed for good with a
    traceback, the breaker told nothing. A length no digit string gives is ignored (as urllib3 does): the body is
    read to the close; one of more digits than `max_bytes` has declares more than it, zeros ahead left out."""
    wav = synthesize_wav("one two")
    if length.startswith(b"0"):  # the body's own length, zeros ahead of it: read as it says
        length += str(len(wav)).encode()
    spec = _spec(serve(_declaring(length, wav)), max_bytes=10_000_000)
    if length.isdigit() and not length.startswith(b"0"):
        with pytest.raises(GeneratorError) as caught:
            _generate(spec)
        assert "exceeds max_bytes=10000000" in str(caught.value) and not caught.value.retryable, caught.value
    else:
        assert _generate(spec).data == wav


def test_a_certificate_this_host_does_not_trust_is_a_misconfigured_endpoint(
    serve: Callable[..., str], tls_certificate: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A self-signed certificate (or another host's, an expired one) fails every request the same way: it was a
    backend error, retried three times with backoff in each job before the lane's breaker opened."""
    url = serve(answering(200, "audio/wav", synthesize_wav("one")), tls=tls_certificate)
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(url))
    assert caught.value.misconfigured and "CERTIFICATE_VERIFY_FAILED" in str(caught.value), caught.value
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls_certificate))
    assert _generate(_spec(url)).data == synthesize_wav("one")  # trusted, the same server answers


def test_an_https_url_to_a_plain_http_port_is_a_misconfigured_endpoint(serve: Callable[..., str]) -> None:
    """A server that answers TLS with plain HTTP (the scheme or the port is wrong) fails every request the same way:
    it was a backend error, each job spending its retries and their backoff before the lane's breaker opened."""
    url = serve(answering(200, "audio/wav", synthesize_wav("one"))).replace("http://", "https://")
    with pytest.raises(GeneratorError) as caught:
        _generate(_spec(url))
    assert caught.value.misconfigured, caught.value
    assert "speaks plain HTTP" in str(caught.value), caught.value
