"""A stage whose generator cannot work is refused at start-up, not found out by every job failing `misconfigured`:
an endpoint that cannot be a URL, a generator that calls a server given none (ANIMASTOR_STAGES, every process),
and a generator this host does not have installed (the GPU worker of that stage)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from animastor_tasks.config import Settings
from animastor_tasks.errors import ConfigError


@pytest.mark.parametrize(
    ("stage", "needle"),
    [
        ({"endpoint": "http://"}, "endpoint"),
        ({"endpoint": "http://host:99999/x"}, "endpoint"),
        ({"endpoint": "http://host:0/x"}, "endpoint"),
        ({"endpoint": "http://ho st/x"}, "endpoint"),
        ({"endpoint": "http://host/x\n"}, "endpoint"),
        ({"endpoint": "http://:8765/v1"}, "endpoint"),
        ({"generator": "openai-speech"}, "openai-speech"),
        ({"generator": "openai-images"}, "openai-images"),
        ({"generator": "http"}, "'http'"),
    ],
)
def test_a_stage_whose_endpoint_cannot_be_called_is_a_config_error(stage: dict[str, str], needle: str) -> None:
    import json

    with pytest.raises(ConfigError, match="ANIMASTOR_STAGES") as info:
        Settings.from_env({"ANIMASTOR_STAGES": json.dumps({"audio": {"media_type": "audio/wav", **stage}})})
    assert needle in str(info.value).split(":", 1)[1]


def test_endpoints_that_are_urls_pass() -> None:
    table = (
        '{"audio": {"endpoint": "http://gpu-box:8765/v1/generate"},'
        ' "image": {"generator": "openai-images", "endpoint": "https://[::1]/v1"}}'
    )
    settings = Settings.from_env({"ANIMASTOR_STAGES": table})
    assert [s.generator for s in settings.stages] == ["http", "openai-images"]


def start_with_a_generator_not_installed(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """A worker started by `argv` (after the Python) with stage audio's generator `htp`, no store listening (nothing
    may be needed to refuse): how it ended, or a test failure when it started."""
    env = {
        **os.environ,
        "ANIMASTOR_LOCAL_DIR": str(tmp_path / "none"),
        "ANIMASTOR_STAGES": '{"audio": {"generator": "htp", "media_type": "audio/wav"}}',
        "ANIMASTOR_REDIS_URL": "redis://127.0.0.1:1/0",
        "ANIMASTOR_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none",
    }
    env.pop("ANIMASTOR_BROKER_URL", None)
    try:
        return subprocess.run(
            [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the worker started: {str(err.stderr)[-500:]}")


def test_a_gpu_worker_whose_generator_is_not_installed_refuses_to_start(tmp_path: Path) -> None:
    """It started healthy and failed every job `misconfigured`; the warm-up said why at DEBUG only."""
    argv = ["-m", "animastor_tasks.operator.cli", "worker", "--stage", "audio", "-P", "solo"]
    done = start_with_a_generator_not_installed(argv, tmp_path)
    assert done.returncode == 2, done.stderr
    assert "generator 'htp' is not installed" in done.stderr


@pytest.mark.parametrize(
    ("stage", "refusal"),
    [
        ({"params": {"fail_rate": 5}}, "param 'fail_rate' must be a number between 0.0 and 1.0, got 5"),
        ({"params": {"steps": 0}}, "param 'steps' must be an integer between 1"),
        ({"generator": "openai-speech", "endpoint": "http://gpu:8000/v1"}, "param 'model' is required"),
        (
            {"generator": "openai-speech", "endpoint": "http://gpu:8000/v1", "params": {"model": "m", "voice": 3}},
            "param 'voice' must be a non-empty string",
        ),
        (
            {"generator": "openai-images", "endpoint": "http://gpu:8000/v1", "params": {"model": "m", "size": "big"}},
            "param 'size' must be a string matching",
        ),
        ({"endpoint": "http://gpu:8000/x", "params": {"read_timeout": -1}}, "param 'read_timeout' must be a number"),
        (
            {"generator": "openai-images", "endpoint": "http://gpu:8000/v1", "params": {"model": "m", "retries": 99}},
            "param 'retries' must be an integer between 0 and 10",
        ),
    ],
)
def test_a_stage_param_its_generator_refuses_stops_the_workers_start(stage: dict[str, object], refusal: str) -> None:
    """Read first by each job: the worker started healthy and failed every job of the stage `misconfigured`."""
    from animastor_tasks.generators import GeneratorError, load_generator

    settings = Settings.from_env({"ANIMASTOR_STAGES": json.dumps({"audio": {"media_type": "audio/wav", **stage}})})
    with pytest.raises(GeneratorError, match=re.escape(refusal)):
        load_generator(settings.registry.get("audio"), settings)


def test_the_params_a_generator_takes_pass_its_start() -> None:
    from animastor_tasks.generators import load_generator

    stages = {
        "audio": {"generator": "openai-speech", "endpoint": "http://g:1/v1", "params": {"model": "m", "speed": 1.5}},
        "image": {"generator": "openai-images", "endpoint": "http://g:1/v1", "params": {"model": "m", "size": "64x64"}},
        "video": {"params": {"fail_rate": 0.5, "steps": 2}},
    }
    settings = Settings.from_env({"ANIMASTOR_STAGES": json.dumps(stages)})
    assert all(load_generator(spec, settings) for spec in settings.stages)


def test_a_media_type_with_parameters_is_compared_by_its_type_and_stored_whole() -> None:
    """Parameters passed the check but not the generators: the builtin one made a hash blob of an `audio/wav; x=1`
    stage, the http one refused every answer of `audio/ogg` for an `audio/ogg; codecs=opus` stage."""
    import requests

    from animastor_tasks.generators import GenerationRequest, load_generator

    stages = {
        "audio": {"media_type": "audio/wav;\tcodecs=1"},
        "image": {"media_type": 'audio/ogg; codecs="opus"', "endpoint": "http://gpu:1/x"},
    }
    settings = Settings.from_env({"ANIMASTOR_STAGES": json.dumps(stages)})
    builtin = load_generator(settings.registry.get("audio"), settings)
    media = builtin.generate(GenerationRequest("b", "c", "s", "audio", "hello", {}), lambda: False, lambda _: None)
    assert media.media_type == "audio/wav" and media.data[:4] == b"RIFF"
    http = load_generator(settings.registry.get("image"), settings)
    answer = requests.Response()
    answer.headers["Content-Type"] = "audio/ogg"
    assert http._check_media_type(answer) == 'audio/ogg; codecs="opus"'  # type: ignore[attr-defined]
