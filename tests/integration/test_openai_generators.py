"""The OpenAI-compatible generators against the real reference inference server (a subprocess)."""

from __future__ import annotations

import socket
import time
from dataclasses import replace
from typing import Any

import pytest

from animastor_tasks.config import Settings
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.errors import ConfigError, GenerationStopped, GeneratorError
from animastor_tasks.generators import GenerationRequest, Generator, Media, load_generator
from animastor_tasks.generators.media import png_size, wav_duration_seconds
from animastor_tasks.generators.openai_images import OpenAIImagesGenerator
from animastor_tasks.generators.openai_speech import OpenAISpeechGenerator

from .test_http_generator import SECRET, StartServer, _RedirectHandler, redirect_url, start_server  # noqa: F401

TEXT = "The knight rode into the silent valley at dusk."


@pytest.fixture(scope="module")
def plain_url(start_server: StartServer) -> str:  # noqa: F811
    return start_server()


def _spec(url: str, stage: str = "audio", *, route: bool = True, **params: Any) -> StageSpec:
    """A stage using the OpenAI generator for `stage`; `route=False` gives the base URL (`.../v1`) instead."""
    speech = stage == "audio"
    path = "/v1/audio/speech" if speech else "/v1/images/generations"
    params = {"model": "tts-1" if speech else "dall-e-2", **params}
    return StageSpec(
        name=stage,
        queue=f"gpu.{stage}",
        media_type=params.pop("media_type", "audio/wav" if speech else "image/png"),
        input_field="text" if speech else "prompt",
        generator="openai-speech" if speech else "openai-images",
        endpoint=url + (path if route else "/v1"),
        params={k: v for k, v in params.items() if v is not None},
    )


def _generator(spec: StageSpec, key: str = "") -> Generator:
    settings = replace(Settings(), inference_api_key=key)
    return OpenAISpeechGenerator(spec, settings) if spec.name == "audio" else OpenAIImagesGenerator(spec, settings)


def _run(spec: StageSpec, key: str = "", text: str = TEXT) -> tuple[Media, list[float]]:
    fractions: list[float] = []
    request = GenerationRequest("book-1", "ch-1", "scene-1", spec.name, text, {})
    return _generator(spec, key).generate(request, lambda: False, fractions.append), fractions


def _fail(spec: StageSpec, key: str = "") -> GeneratorError:
    with pytest.raises(GeneratorError) as info:
        _run(spec, key)
    assert not isinstance(info.value, GenerationStopped)
    return info.value


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("route", [True, False], ids=["full-route", "base-url"])
def test_speech_returns_a_real_wav(plain_url: str, route: bool) -> None:
    media, fractions = _run(_spec(plain_url, "audio", route=route, voice="nova"), text=" ".join(["word"] * 20))
    assert media.media_type == "audio/wav"
    assert wav_duration_seconds(media.data) == pytest.approx(20 * 0.12)
    assert fractions[0] == 0.0 and fractions[-1] == 1.0


def test_speech_passes_extra_params_as_body_fields(plain_url: str) -> None:
    media, _ = _run(_spec(plain_url, "audio", speed=2.0), text=" ".join(["word"] * 20))
    assert wav_duration_seconds(media.data) == pytest.approx(20 * 0.06)


@pytest.mark.parametrize("route", [True, False], ids=["full-route", "base-url"])
def test_images_returns_a_real_png(plain_url: str, route: bool) -> None:
    first, fractions = _run(_spec(plain_url, "image", route=route), text="a lighthouse in fog")
    again, _ = _run(_spec(plain_url, "image", route=route), text="a lighthouse in fog")
    assert first.media_type == "image/png"
    assert png_size(first.data) == (64, 64)  # the server's default when no size is configured
    assert first.data == again.data
    assert fractions[-1] == 1.0


def test_images_sends_the_configured_size(plain_url: str) -> None:
    media, _ = _run(_spec(plain_url, "image", size="128x96"), text="a lighthouse in fog")
    assert png_size(media.data) == (128, 96)


@pytest.mark.parametrize("stage", ["audio", "image"])
def test_bearer_key_is_sent_and_a_wrong_one_is_a_clear_401(start_server: StartServer, stage: str) -> None:  # noqa: F811
    url = start_server("--api-key", SECRET)
    media, _ = _run(_spec(url, stage), key=SECRET)
    assert media.data
    for key in ("wrong-key-123", ""):
        err = _fail(_spec(url, stage), key=key)
        assert err.retryable is False
        assert "401" in str(err)
        assert "missing or invalid API key" in str(err)  # the server's own message, from OpenAI's error shape
        if key:
            assert key not in str(err)


@pytest.mark.parametrize("stage", ["audio", "image"])
def test_503_with_retry_after_is_waited_out_then_succeeds(start_server: StartServer, stage: str) -> None:  # noqa: F811
    url = start_server("--fail-first", "1", "--retry-after", "1", "--api-key", SECRET)
    started = time.monotonic()
    media, _ = _run(_spec(url, stage), key=SECRET)
    elapsed = time.monotonic() - started
    assert media.data
    assert 1.0 <= elapsed < 5.0  # the server asked for one second, and got it


def test_retry_after_is_capped_by_max_retry_after(start_server: StartServer) -> None:  # noqa: F811
    url = start_server("--fail-first", "2", "--retry-after", "3600")
    started = time.monotonic()
    media, _ = _run(_spec(url, "audio", max_retry_after=0.2))
    assert wav_duration_seconds(media.data) > 0
    assert time.monotonic() - started < 3.0


def test_retries_spent_is_a_retryable_error_with_the_server_message(start_server: StartServer) -> None:  # noqa: F811
    url = start_server("--fail-first", "5", "--retry-after", "0.1")
    err = _fail(_spec(url, "image", retries=1))
    assert err.retryable is True
    assert "503" in str(err)
    assert "injected failure" in str(err)


def test_503_without_retry_after_is_left_to_the_worker(start_server: StartServer) -> None:  # noqa: F811
    url = start_server("--fail-first", "1")
    err = _fail(_spec(url, "audio"))
    assert err.retryable is True and "503" in str(err)
    media, _ = _run(_spec(url, "audio"))  # the worker's next attempt
    assert wav_duration_seconds(media.data) > 0


def test_stop_while_waiting_out_retry_after(start_server: StartServer) -> None:  # noqa: F811
    url = start_server("--fail-first", "1", "--retry-after", "30")
    generator = _generator(_spec(url, "audio"))
    request = GenerationRequest("book-1", "ch-1", "scene-1", "audio", TEXT, {})
    stop_at = time.monotonic() + 0.5
    started = time.monotonic()
    with pytest.raises(GenerationStopped):
        generator.generate(request, lambda: time.monotonic() > stop_at, lambda _: None)
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize(
    ("stage", "params", "message"),
    [
        ("audio", {"response_format": "mp3", "media_type": "audio/mpeg"}, "response_format 'mp3' is not supported"),
        ("image", {"size": "2048x2048"}, "'size' must be"),
        ("image", {"n": 3}, None),  # `n` is the generator's own field: always 1, never an error
    ],
)
def test_server_4xx_is_not_retryable_and_carries_its_message(
    plain_url: str, stage: str, params: dict[str, Any], message: str | None
) -> None:
    spec = _spec(plain_url, stage, **params)
    if message is None:
        media, _ = _run(spec)
        assert png_size(media.data) == (64, 64)
        return
    err = _fail(spec)
    assert err.retryable is False
    assert "400" in str(err)
    assert message in str(err)


@pytest.mark.parametrize("stage", ["audio", "image"])
def test_redirect_is_refused_not_followed(redirect_url: str, stage: str) -> None:  # noqa: F811
    err = _fail(_spec(redirect_url, stage), key=SECRET)
    assert err.retryable is False
    assert "302" in str(err) and "'elsewhere.example'" in str(err)
    assert SECRET not in str(err)
    assert _RedirectHandler.hits == ["/v1/audio/speech" if stage == "audio" else "/v1/images/generations"]


@pytest.mark.parametrize(
    ("stage", "params", "message"),
    [
        ("audio", {"model": None}, "param 'model' is required"),
        ("audio", {"voice": 3}, "param 'voice' must be"),
        ("audio", {"response_format": "ogg-vorbis"}, "param 'response_format' must be one of"),
        ("audio", {"response_format": "mp3"}, "gives audio/mpeg but stage 'audio' stores audio/wav"),
        ("image", {"model": ""}, "param 'model' must be"),
        ("image", {"response_format": "url"}, "param 'response_format' must be one of ['b64_json']"),
        ("image", {"size": "big"}, "param 'size' must be a string matching"),
        ("image", {"retries": -1}, "param 'retries' must be an integer"),
        ("audio", {"read_timeout": 0}, "param 'read_timeout' must be a number"),
    ],
)
def test_bad_params_fail_before_anything_is_sent(stage: str, params: dict[str, Any], message: str) -> None:
    err = _fail(_spec(_closed_port_url(), stage, **params))  # a request would be a connection error instead
    assert err.retryable is False
    assert message in str(err)


@pytest.mark.parametrize("endpoint", [None, "ftp://gpu-box/v1"])
def test_missing_or_odd_endpoint_is_a_config_error(endpoint: str | None) -> None:
    spec = StageSpec(name="audio", queue="gpu.audio", media_type="audio/wav", generator="openai-speech")
    with pytest.raises(ConfigError, match="'audio'"):
        OpenAISpeechGenerator(replace(spec, endpoint=endpoint), Settings())


def test_entry_points_find_both_generators(plain_url: str) -> None:
    speech = load_generator(_spec(plain_url, "audio"), Settings())
    images = load_generator(_spec(plain_url, "image"), Settings())
    assert isinstance(speech, OpenAISpeechGenerator) and isinstance(images, OpenAIImagesGenerator)
