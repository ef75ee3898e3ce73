"""docker-compose.yml validates with the real compose client, requires its secrets and defines the whole stack.

`config` needs no Docker engine. Skipped only where docker itself is not installed; a docker CLI without
any compose (plugin or `docker-compose`) is a set-up error and fails with how to fix it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import missing

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {
    "POSTGRES_PASSWORD": "pg-secret",
    "REDIS_PASSWORD": "redis-secret",
    "ANIMASTOR_FLOWER_BASIC_AUTH": "ops:flower-secret",
}
SERVICES = ("postgres", "redis", "migrate", "control", "beat", "worker-audio", "worker-image", "flower", "metrics")
LONG_RUNNING = ("postgres", "redis", "control", "beat", "worker-audio", "worker-image", "flower", "metrics")


def compose() -> list[str]:
    if shutil.which("docker") is None:
        missing("docker is not installed (the compose file is validated where it is)")
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=60)
    if probe.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail(
        "docker is installed but no compose implementation is: install the compose plugin "
        "(docker-compose-plugin) or docker-compose (Debian: apt-get install -y docker-compose)"
    )


def run_compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in SECRETS and not k.startswith("COMPOSE_")}
    return subprocess.run(
        [*compose(), "-f", str(ROOT / "docker-compose.yml"), *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def services(rendered: str) -> dict[str, str]:
    """The normalised `config` output cut into one text block per service."""
    body = rendered.split("\nservices:\n", 1)[1] if "\nservices:\n" in rendered else rendered.split("services:\n", 1)[1]
    body = re.split(r"\n[a-z]", body, maxsplit=1)[0]  # up to the next top-level key (volumes:, networks:)
    blocks: dict[str, str] = {}
    for chunk in re.split(r"\n(?=  [a-z][a-z0-9-]*:\n)", "\n" + body):
        name = re.match(r"\s*([a-z][a-z0-9-]*):", chunk)
        if name:
            blocks[name.group(1)] = chunk
    return blocks


def test_compose_file_validates() -> None:
    proc = run_compose("config", "-q", env=SECRETS)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_compose_refuses_to_run_without_its_secrets(missing: str) -> None:
    proc = run_compose("config", "-q", env={k: v for k, v in SECRETS.items() if k != missing})
    assert proc.returncode != 0
    assert missing in proc.stderr + proc.stdout


def test_compose_defines_the_whole_stack() -> None:
    proc = run_compose("config", env=SECRETS)
    assert proc.returncode == 0, proc.stderr
    blocks = services(proc.stdout)
    assert set(SERVICES) <= set(blocks), sorted(blocks)
    for name in LONG_RUNNING:
        assert "healthcheck:" in blocks[name], f"{name} has no healthcheck"
    for stage in ("audio", "image"):
        block = blocks[f"worker-{stage}"]
        assert re.search(r"capabilities:\s*\n\s*- gpu", block), block
        assert "driver: nvidia" in block
        assert "CUDA_VISIBLE_DEVICES" in block
        assert re.search(rf"- --stage\n\s*- {stage}\n", block), block
    assert "flowerconfig.py" in blocks["flower"]
    assert "ANIMASTOR_FLOWER_BASIC_AUTH: ops:flower-secret" in blocks["flower"]
    for name in ("flower", "metrics"):  # published on the host's loopback only
        assert "127.0.0.1" in blocks[name], blocks[name]
    assert "0.0.0.0:" not in proc.stdout
    assert "condition: service_healthy" in blocks["control"]
    assert "condition: service_completed_successfully" in blocks["control"]
