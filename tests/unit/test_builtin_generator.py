"""The builtin generator: real media, progress, prompt stops, injected failures; and the loader."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from animastor_tasks.config import Settings
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.errors import ConfigError, GenerationStopped, GeneratorError
from animastor_tasks.generators import (
    GenerationRequest,
    Generator,
    known_generators,
    load_generator,
)
from animastor_tasks.generators.builtin import BuiltinGenerator
from animastor_tasks.generators.media import png_size, wav_duration_seconds

AUDIO = StageSpec(name="audio", queue="gpu.audio", input_field="text", media_type="audio/wav")
IMAGE = StageSpec(name="image", queue="gpu.image", input_field="prompt", media_type="image/png")
VIDEO = StageSpec(name="video", queue="gpu.video", input_field="prompt", media_type="video/mp4")


def _request(stage: str = "audio", text: str = "It was a dark and stormy night.", **params: Any) -> GenerationRequest:
    return GenerationRequest("book-1", "ch-1", "scene-1", stage, text, params)


class Recorder:
    """should_stop/progress callbacks that remember how they were called."""

    def __init__(self, stop_after: float | None = None) -> None:
        self.stop_checks = 0
        self.fractions: list[float] = []
        self.stop = threading.Event()
        self.stopped_at: float | None = None
        if stop_after is not None:
            self._timer = threading.Timer(stop_after, self._set)
            self._timer.start()

    def _set(self) -> None:
        self.stopped_at = time.monotonic()
        self.stop.set()

    def should_stop(self) -> bool:
        self.stop_checks += 1
        return self.stop.is_set()

    def progress(self, fraction: float) -> None:
        self.fractions.append(fraction)


def _generate(spec: StageSpec, request: GenerationRequest, rec: Recorder) -> Any:
    return BuiltinGenerator(spec, Settings()).generate(request, rec.should_stop, rec.progress)


def test_audio_is_a_wav_of_the_text_with_progress_per_step() -> None:
    rec = Recorder()
    media = _generate(AUDIO, _request(text=" ".join(["word"] * 20)), rec)
    assert media.media_type == "audio/wav"
    assert wav_duration_seconds(media.data) == pytest.approx(20 * 0.12)
    assert rec.fractions == [0.25, 0.5, 0.75, 1.0]
    assert rec.stop_checks >= 5  # before every step and once before rendering


def test_steps_param_sets_the_number_of_progress_reports() -> None:
    rec = Recorder()
    _generate(AUDIO, _request(steps=10), rec)
    assert rec.fractions == pytest.approx([i / 10 for i in range(1, 11)])
    assert rec.fractions == sorted(rec.fractions)


def test_image_is_a_png_and_deterministic() -> None:
    first = _generate(IMAGE, _request("image", "a red fox"), Recorder())
    second = _generate(IMAGE, _request("image", "a red fox"), Recorder())
    other = _generate(IMAGE, _request("image", "a blue fox"), Recorder())
    assert first.media_type == "image/png"
    assert png_size(first.data) == (64, 64)
    assert first.data == second.data
    assert first.data != other.data


def test_unknown_media_type_gives_a_stable_blob() -> None:
    media = _generate(VIDEO, _request("video", "a chase"), Recorder())
    assert media.media_type == "application/octet-stream"
    assert len(media.data) == 32 * 32
    assert media.data == _generate(VIDEO, _request("video", "a chase"), Recorder()).data
    assert media.data != _generate(VIDEO, _request("video", "a rest"), Recorder()).data


def test_step_seconds_makes_the_job_slow() -> None:
    started = time.monotonic()
    _generate(AUDIO, _request(steps=3, step_seconds=0.1), Recorder())
    assert time.monotonic() - started >= 0.3


def test_stop_is_seen_within_a_fifth_of_a_second_in_a_slow_step() -> None:
    rec = Recorder(stop_after=0.3)
    started = time.monotonic()
    with pytest.raises(GenerationStopped) as info:
        _generate(AUDIO, _request(steps=2, step_seconds=30), rec)
    caught = time.monotonic()
    assert rec.stopped_at is not None
    assert caught - rec.stopped_at < 0.2
    assert caught - started < 1.0
    assert info.value.retryable is False
    assert rec.fractions == []


def test_stop_before_start_produces_nothing() -> None:
    rec = Recorder()
    rec.stop.set()
    with pytest.raises(GenerationStopped):
        _generate(AUDIO, _request(), rec)
    assert rec.fractions == []


def test_fail_rate_one_always_raises_a_retryable_error() -> None:
    for _ in range(5):
        with pytest.raises(GeneratorError) as info:
            _generate(AUDIO, _request(fail_rate=1, steps=4), Recorder())
        assert not isinstance(info.value, GenerationStopped)
        assert info.value.retryable is True
        assert "injected failure" in str(info.value)


def test_fail_rate_zero_never_fails() -> None:
    for _ in range(20):
        assert _generate(AUDIO, _request(fail_rate=0, steps=1), Recorder()).data


@pytest.mark.parametrize(
    "params",
    [
        {"steps": 0},
        {"steps": 2.5},
        {"steps": "4"},
        {"fail_rate": 1.5},
        {"step_seconds": -1},
        {"steps": True},
        {"step_secondz": 3},  # a misspelt knob: every job ran at the default, nothing said
    ],
)
def test_bad_params_are_not_retryable(params: Mapping[str, Any]) -> None:
    with pytest.raises(GeneratorError) as info:
        _generate(AUDIO, _request(**params), Recorder())
    assert info.value.retryable is False
    assert next(iter(params)) in str(info.value)


def test_load_generator_finds_builtin_through_entry_points() -> None:
    assert {"builtin", "http"} <= set(known_generators())
    generator = load_generator(AUDIO, Settings())
    assert isinstance(generator, BuiltinGenerator)
    assert isinstance(generator, Generator)
    assert generator.name == "builtin"


def test_load_generator_unknown_name_is_a_config_error_listing_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_generator(replace(AUDIO, generator="diffusion9000"), Settings())
    message = str(info.value)
    for expected in ("'audio'", "'diffusion9000'", "builtin", "http"):
        assert expected in message


def test_load_generator_http_without_endpoint_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="endpoint"):
        load_generator(replace(AUDIO, generator="http"), Settings())


def test_stage_fingerprint_is_stable_and_sensitive() -> None:
    a = replace(AUDIO, params={"steps": 4, "voice": "alto"})
    b = replace(AUDIO, params={"voice": "alto", "steps": 4})
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != replace(a, params={"steps": 5, "voice": "alto"}).fingerprint
    assert a.fingerprint != replace(a, generator="http").fingerprint
    assert '"builtin"' in a.fingerprint


def test_a_stage_with_an_unknown_param_is_refused_when_its_generator_is_built() -> None:
    """A worker builds its stages' generators as it starts (`refuse_generators_not_built`): a stage the builtin
    generator cannot run as written stops that start, naming the param and the ones it takes."""
    with pytest.raises(GeneratorError) as info:
        BuiltinGenerator(replace(AUDIO, params={"steps": 2, "step_secondz": 3}), Settings())
    assert info.value.misconfigured
    assert "unknown param(s) 'step_secondz'; it takes steps, step_seconds, fail_rate" in str(info.value)
