"""Answers real third-party inference servers give that are not what the protocol asks, each taken for what it
says: a 503 that names a time is the server's refusal of whoever asks, a JSON error under 200 is worth another
attempt, an error page is never media, and media written by common tools passes.

Each server is a real HTTP server on a loopback port (the harness of test_hostile_inference.py).
"""

from __future__ import annotations

import base64
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from http.server import BaseHTTPRequestHandler

import pytest

from animastor_tasks.domain.job_rules import Verdict, classify_error, verdict
from animastor_tasks.errors import GeneratorError
from animastor_tasks.generators.media import render_png, synthesize_wav
from tests.integration.test_hostile_inference import Answer, _generate, _spec, answering, serve  # noqa: F401
from tests.unit.test_audio_frames import ogg_stream
from tests.unit.test_flac import flac

Serve = Callable[[Answer], str]


def _refusal(spec_of: Callable[[str], object], answer: Answer, serve: Serve) -> GeneratorError:  # noqa: F811
    with pytest.raises(GeneratorError) as info:
        _generate(spec_of(serve(answer)))  # type: ignore[arg-type]
    return info.value


@pytest.mark.parametrize("after", ["120", "Wed, 21 Oct 2037 07:28:00 GMT"])
def test_a_503_that_says_when_to_come_back_gives_the_pair_back(after: str, serve: Serve) -> None:  # noqa: F811
    """A server loading its model or with a full queue answers 503 and a Retry-After: the verdict on a backend error
    while the breaker was closed failed the first scenes of every restart for good, healthy scenes an operator had
    to regenerate by hand. It is a rate limit now, as a 429 is: the pair goes back to `pending`."""
    answer = answering(503, "application/json", b'{"error": "model loading"}', headers={"Retry-After": after})
    err = _refusal(_spec, answer, serve)
    assert err.rate_limited and err.retryable and "model loading" in str(err), err
    assert verdict(classify_error(err), "closed") is Verdict.GIVE_BACK

    bare = _refusal(_spec, answering(503, "text/plain", b"overloaded"), serve)
    assert bare.retryable and not bare.rate_limited, bare  # no time named: a backend error, as before


def _riff_wav(data_length: int) -> bytes:
    """A mono 16-bit WAV as SoX and espeak-ng write one to a pipe: the data length they cannot seek back to fix."""
    whole = synthesize_wav("one two three")
    frames = whole[44:]
    fmt = struct.pack("<HHIIHH", 1, 1, 16000, 32000, 2, 16)
    chunks = b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", data_length) + frames
    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + chunks


@pytest.mark.parametrize("generator", ["http", "openai-speech"])
def test_a_wav_piped_out_of_sox_or_espeak_is_audio(generator: str, serve: Serve) -> None:  # noqa: F811
    """Their data length 0x7FFFF000 failed every scene of the lane as a WAV cut short, after a full GPU run each."""
    body = _riff_wav(0x7FFFF000)
    media = _generate(_spec(serve(answering(200, "audio/wav", body)), generator=generator, model="tts"))
    assert media.data == body and media.media_type == "audio/wav"


def test_a_flac_answered_for_another_format_is_the_servers_setup(serve: Serve) -> None:  # noqa: F811
    """A server that ignores `response_format` answers every scene in its own format: FLAC was not among the formats
    tried, so each scene failed as its own fault, at full speed, the breaker told nothing."""
    err = _refusal(
        lambda url: _spec(url, generator="openai-speech", model="tts"), answering(200, "audio/flac", flac()), serve
    )
    assert err.misconfigured and "audio/flac" in str(err) and "response_format 'wav'" in str(err), err


@pytest.mark.parametrize("generator", ["http", "openai-speech"])
def test_a_json_error_under_200_is_the_servers_words_and_worth_another_attempt(
    generator: str,
    serve: Serve,  # noqa: F811
) -> None:
    """Refused as a confused content type before its body was read: the server's words were lost and the scene
    failed, not retried. The images generator already read it so."""
    body = b'{"error": {"message": "model loading, try again"}}'
    err = _refusal(
        lambda url: _spec(url, generator=generator, model="tts"), answering(200, "application/json", body), serve
    )
    assert err.retryable and not err.misconfigured and "model loading, try again" in str(err), err

    other = b'{"voices": ["alto"]}'  # JSON that is no error: the endpoint is not the speech route
    err = _refusal(
        lambda url: _spec(url, generator=generator, model="tts"), answering(200, "application/json", other), serve
    )
    assert err.misconfigured and "voices" in str(err), err


@pytest.mark.parametrize(
    ("media_type", "body", "retryable"),
    [
        ("application/json", b'{"error": "CUDA out of memory"}', True),
        ("text/html; charset=utf-8", b"<html><body>Sign in</body></html>", False),
    ],
)
def test_a_stage_of_any_bytes_does_not_store_an_error_page(
    media_type: str,
    body: bytes,
    retryable: bool,
    serve: Serve,  # noqa: F811
) -> None:
    """A stage of `application/octet-stream` took any Content-Type: a 200 carrying the server's JSON error or a
    proxy's login page was stored as the scene's media and the pair marked `ready`."""

    def octets(url: str) -> object:
        return replace(_spec(url), media_type="application/octet-stream")

    err = _refusal(octets, answering(200, media_type, body), serve)
    assert err.retryable is retryable and err.misconfigured is not retryable, err
    if retryable:
        assert "CUDA out of memory" in str(err)
    media = _generate(octets(serve(answering(200, "application/x-custom", b"\x00model bytes"))))  # type: ignore[arg-type]
    assert media.data == b"\x00model bytes"


def _png_b64(shape: Callable[[bytes], str]) -> bytes:
    return b'{"data": [{"b64_json": "%s"}]}' % shape(render_png("a tower")).encode()


@pytest.mark.parametrize(
    "shape",
    [
        lambda b: base64.encodebytes(b).decode().replace("\n", "\\n"),  # wrapped in lines of 76
        lambda b: "data:image/png;base64," + base64.b64encode(b).decode(),
        lambda b: base64.urlsafe_b64encode(b).decode().rstrip("="),
    ],
    ids=["wrapped", "data-url", "urlsafe-unpadded"],
)
def test_an_image_in_the_base64_variants_servers_write_is_an_image(
    shape: Callable[[bytes], str],
    serve: Serve,  # noqa: F811
) -> None:
    """Each was refused as a server that ignores `response_format b64_json`, which it had honoured: the lane's
    breaker opened on a server that sent its images, and every image pair waited."""
    url = serve(answering(200, "application/json", _png_b64(shape)))
    media = _generate(_spec(url, "image", "openai-images", model="img"))
    assert media.data == render_png("a tower") and media.media_type == "image/png"


def test_a_b64_json_that_is_not_base64_says_so(serve: Serve) -> None:  # noqa: F811
    err = _refusal(
        lambda url: _spec(url, "image", "openai-images", model="img"),
        answering(200, "application/json", b'{"data": [{"b64_json": "not*base64!"}]}'),
        serve,
    )
    assert err.misconfigured and "not base64" in str(err), err


def test_media_under_the_other_names_of_its_type_is_media(serve: Serve) -> None:  # noqa: F811
    """An Opus answer as `application/ogg` was refused as no audio type, and a JPEG for a stage of `image/jpg` as an
    image of another type: each a server that answered every scene right, refused as set up wrong."""
    url = serve(answering(200, "application/ogg", ogg_stream()))
    speech = _generate(replace(_spec(url, generator="openai-speech", model="tts"), media_type="audio/ogg"))
    assert speech.data == ogg_stream() and speech.media_type == "audio/ogg"

    jpeg = b"\xff\xd8\xff\xe0" + bytes(200) + b"\xff\xda" + bytes(300) + b"\xff\xd9"
    url = serve(answering(200, "application/json", _png_b64(lambda _: base64.b64encode(jpeg).decode())))
    image = _generate(replace(_spec(url, "image", "openai-images", model="img"), media_type="image/jpg"))
    assert image.data == jpeg and image.media_type == "image/jpg"


def test_a_redirect_is_refused_without_reading_its_body(serve: Serve) -> None:  # noqa: F811
    """requests reads the whole body of a redirect it does not follow, into memory and past `max_bytes`: a server
    answering 302 with gigabytes held the job for its `total_timeout` (then failed it as a timeout, not as the
    redirect it was) and could kill the worker for its memory."""
    sent = [0]
    done = threading.Event()

    def huge_redirect(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", "http://elsewhere.example/v1")
        handler.send_header("Content-Length", str(1 << 30))
        handler.end_headers()
        chunk = b"x" * 65536
        try:
            while sent[0] < 1 << 30 and not done.is_set():
                handler.wfile.write(chunk)
                sent[0] += len(chunk)
        finally:
            done.set()

    started = time.monotonic()
    err = _refusal(lambda url: _spec(url, max_bytes=1 << 20, total_timeout=5), huge_redirect, serve)
    took = time.monotonic() - started
    done.set()
    assert err.misconfigured and "redirect" in str(err) and "elsewhere.example" in str(err), err
    assert took < 2.0 and sent[0] < 64 << 20, (took, sent[0])


@pytest.mark.parametrize(
    ("generator", "status", "body", "misconfigured"),
    [
        # OpenAI's shape names the refused field in error.param; FastAPI's (most self-hosted servers) in detail's loc.
        ("openai-speech", 400, b'{"error": {"message": "Invalid value for \'voice\'", "param": "voice"}}', True),
        ("openai-speech", 422, b'{"detail": [{"loc": ["body", "speed"], "msg": "must be <= 4"}]}', True),
        ("openai-images", 400, b'{"error": {"message": "bad size", "param": "size"}}', True),
        ("openai-speech", 400, b'{"object": "error", "message": "no such voice", "param": "voice"}', True),  # vLLM
        ("http", 422, b'{"detail": [{"loc": ["body", "params", "voice"], "msg": "unknown voice"}]}', True),
        # The scene's own text refused (too long, unreadable): a verdict on the scene.
        ("openai-speech", 400, b'{"error": {"message": "input too long", "param": "input"}}', False),
        ("openai-speech", 422, b'{"detail": [{"loc": ["body", "input"], "msg": "too long"}]}', False),
        ("openai-images", 400, b'{"error": {"message": "prompt refused", "param": "prompt"}}', False),
        ("http", 422, b'{"detail": [{"loc": ["body", "input"], "msg": "too long"}]}', False),
        # Naming nothing, or nothing readable: the scene's, as before.
        ("openai-speech", 400, b'{"error": {"message": "no", "param": null}}', False),
        ("http", 400, b'{"error": "bad request"}', False),
        ("http", 422, b'{"detail": [1, null, {"loc": 5}, {"loc": [{}, 3]}, {"loc": "voice"}]}', False),
        ("http", 400, b'{"detail": [{"loc": ["body"], "msg": "invalid"}]}', False),
    ],
)
def test_a_refusal_naming_a_stage_setting_is_misconfigured_and_one_naming_the_input_is_the_scenes(
    generator: str,
    status: int,
    body: bytes,
    misconfigured: bool,
    serve: Serve,  # noqa: F811
) -> None:
    """A wrong `voice` or a `speed` out of range was each scene's verdict: every pair of the lane failed for good,
    at full speed, the breaker told nothing, and every book had to be commanded again."""
    stage = "image" if generator == "openai-images" else "audio"
    err = _refusal(
        lambda url: _spec(url, stage, generator, model="m"), answering(status, "application/json", body), serve
    )
    assert (err.misconfigured, err.retryable) == (misconfigured, False), err
    assert f"answered {status}" in str(err)
