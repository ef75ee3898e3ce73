"""docker-compose.yml (and its CPU override) validates with the real compose client, requires its secrets and
defines the whole stack; beat's healthcheck really answers.

`config` needs no Docker engine. Where docker or a compose implementation is missing, the compose tests skip
saying so (and fail under CI=true, whose .ci/run installs both); the healthcheck test needs neither.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from animastor_tasks.adapters.redis.counters import histogram_field
from animastor_tasks.config import Settings
from animastor_tasks.domain.keys import Keyspace
from tests.support import missing

ROOT = Path(__file__).resolve().parents[2]
BASE = ("docker-compose.yml",)
CPU = ("docker-compose.yml", "docker-compose.cpu.yml")
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
    missing("docker is installed but no compose implementation is (apt-get install -y docker-compose)")


def run_compose(*args: str, env: dict[str, str], files: tuple[str, ...] = BASE) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in SECRETS and not k.startswith(("COMPOSE_", "ANIMASTOR_"))}
    return subprocess.run(
        [*compose(), *(arg for f in files for arg in ("-f", str(ROOT / f))), *args],
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


def seconds(duration: str) -> float:
    """A compose duration (`33m`, `1h2m3s`, `1980s`, `33m0s`) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", duration.strip().strip("'\""))
    assert parts and duration.strip(), f"not a duration: {duration!r}"
    h, m, s = parts.groups()
    return int(h or 0) * 3600 + int(m or 0) * 60 + float(s or 0)


def environment(block: str) -> dict[str, str]:
    env = block.split("    environment:\n", 1)[1]
    return dict(re.findall(r"^      ([A-Z_][A-Z0-9_]*): ?(.*)$", re.split(r"\n    [a-z]", env, maxsplit=1)[0], re.M))


def test_compose_file_validates() -> None:
    for files in (BASE, CPU):
        proc = run_compose("config", "-q", env=SECRETS, files=files)
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
    assert re.search(r"- animastor-tasks\n\s*- flower\n", blocks["flower"]), blocks["flower"]
    assert "ANIMASTOR_FLOWER_BASIC_AUTH: ops:flower-secret" in blocks["flower"]
    for name in ("flower", "metrics"):  # published on the host's loopback only
        assert "127.0.0.1" in blocks[name], blocks[name]
    assert "0.0.0.0:" not in proc.stdout
    assert "condition: service_healthy" in blocks["control"]
    assert "condition: service_completed_successfully" in blocks["control"]


def test_gpu_workers_wait_for_their_job_when_stopped() -> None:
    """Docker kills a container 10 s after SIGTERM unless told otherwise; a GPU job may run until the hard
    time limit, so every GPU worker's grace period outlasts it (with the CPU override as well)."""
    limit = Settings().job_time_limit
    for files, workers in ((BASE, ("worker-audio", "worker-image")), (CPU, ("worker-audio-cpu", "worker-image-cpu"))):
        proc = run_compose("config", env=SECRETS, files=files)
        assert proc.returncode == 0, proc.stderr
        blocks = services(proc.stdout)
        for name in workers:
            grace = re.search(r"^    stop_grace_period: (\S+)$", blocks[name], re.M)
            assert grace, f"{name} has no stop_grace_period"
            assert seconds(grace.group(1)) > limit + 30, f"{name}: {grace.group(1)} vs job time limit {limit} s"


def test_the_control_worker_is_given_the_systemd_unit_s_stop_time() -> None:
    """Docker's default 10 s could SIGKILL a regenerate or Stop All waiting out its 10 s lock bound: its caller heard
    nothing. The control service waits as long as `animastor-control.service` (TimeoutStopSec), with every file."""
    unit = (ROOT / "deploy" / "systemd" / "animastor-control.service").read_text()
    stop = re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M)
    assert stop, unit
    for files in (BASE, CPU, (*BASE, "docker-compose.control-host.yml")):  # a control host's artifacts: on S3
        proc = run_compose("config", env={**SECRETS, **S3_STORE}, files=files)
        assert proc.returncode == 0, proc.stderr
        grace = re.search(r"^    stop_grace_period: (\S+)$", services(proc.stdout)["control"], re.M)
        assert grace and seconds(grace.group(1)) == int(stop.group(1)), (files, grace)


def test_cpu_override_runs_the_gpu_workers_without_a_gpu() -> None:
    proc = run_compose("config", env=SECRETS, files=CPU)
    assert proc.returncode == 0, proc.stderr
    blocks = services(proc.stdout)
    for stage in ("audio", "image"):
        gpu, cpu = blocks[f"worker-{stage}"], blocks[f"worker-{stage}-cpu"]
        assert re.search(r"profiles:\n\s*- gpu\n", gpu), gpu  # not started unless --profile gpu
        assert "nvidia" not in cpu and "capabilities" not in cpu, cpu
        assert re.search(rf"- --stage\n\s*- {stage}\n", cpu), cpu
        assert f'"{stage}@$$HOSTNAME"' in cpu, cpu  # its healthcheck pings its own node
        # The same settings as the GPU worker, so that the two files cannot drift apart.
        expected = {k: v for k, v in environment(gpu).items() if k != "CUDA_VISIBLE_DEVICES"}
        assert environment(cpu) == expected
        assert "artifacts:/var/lib/animastor/artifacts" in cpu
    up = run_compose("config", "--services", env=SECRETS, files=CPU)
    assert up.returncode == 0, up.stderr


def test_beat_healthcheck_answers_from_the_recorded_tick() -> None:
    """The exact code of beat's healthcheck: unhealthy (1) with no tick recorded, healthy (0) after a fresh one,
    unhealthy again once the tick is older than three tick periods."""
    text = (ROOT / "docker-compose.yml").read_text()
    beat = text.split("\n  beat:\n", 1)[1].split("\n  worker-audio:\n", 1)[0]
    code = re.search(r'^\s*- "(import sys;[^"]*)"$', beat, re.M)
    assert code, beat
    settings = Settings.from_env()
    prefix = f"hc{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "ANIMASTOR_KEY_PREFIX": prefix, "ANIMASTOR_TICK_SECONDS": "5"}
    key, field = Keyspace(prefix).metrics(), histogram_field("tick_seconds", "last")
    client = redis.Redis.from_url(settings.redis_url)

    def check() -> int:
        return subprocess.run([sys.executable, "-c", code.group(1)], env=env, timeout=60, check=False).returncode

    try:
        assert check() == 1
        client.hset(key, field, str(time.time()))
        assert check() == 0
        client.hset(key, field, str(time.time() - 16))
        assert check() == 1
    finally:
        client.delete(key)
        client.close()


def test_the_control_host_overlay_serves_gpu_hosts_of_their_own() -> None:
    """docker-compose.yml was the documented control host of a farm of several hosts, but it published neither
    Postgres nor Redis (the GPU hosts could not connect), kept the artifacts on a local volume, and passed no
    ANIMASTOR_BROKER_URL: with RabbitMQ on the GPU hosts, the control worker published their jobs to a Redis
    list nobody consumed."""
    files = ("docker-compose.yml", "docker-compose.control-host.yml")
    farm = {
        "ANIMASTOR_ARTIFACT_URL": "s3://farm-artifacts/prod",
        "AWS_ACCESS_KEY_ID": "key-id",
        "AWS_SECRET_ACCESS_KEY": "key-secret",
        "ANIMASTOR_BROKER_URL": "amqp://animastor:amqp-secret@rabbit.example:5672/animastor",
        "ANIMASTOR_PRESENCE_TTL_SECONDS": "8",
    }
    proc = run_compose("config", env={**SECRETS, **farm}, files=files)
    assert proc.returncode == 0, proc.stderr
    blocks = services(proc.stdout)
    for name, port in (("postgres", 5432), ("redis", 6379)):
        assert re.search(rf"published: ['\"]?{port}\b|0\.0\.0\.0:{port}:{port}", blocks[name]), blocks[name]
    for name in ("control", "beat", "flower", "metrics"):
        env = environment(blocks[name])
        assert env["ANIMASTOR_BROKER_URL"].strip("'\"") == farm["ANIMASTOR_BROKER_URL"], (name, env)
        assert env["ANIMASTOR_ARTIFACT_URL"].strip("'\"") == farm["ANIMASTOR_ARTIFACT_URL"], (name, env)
        assert env["ANIMASTOR_PRESENCE_TTL_SECONDS"].strip("'\"") == "8", (name, env)
        assert "ANIMASTOR_SILENT_WORKER_SECONDS" in env, (name, env)
    refused = run_compose("config", "-q", env=SECRETS, files=files)  # no shared artifact store named
    assert refused.returncode != 0 and "ANIMASTOR_ARTIFACT_URL" in refused.stderr + refused.stdout


def test_a_longer_presence_ttl_alone_gives_settings_the_processes_accept() -> None:
    """Every compose file passed ANIMASTOR_SILENT_WORKER_SECONDS=30 when it was unset: with the presence TTL raised
    to 20 s (valid on its own), the silence setting was below twice the TTL and every process refused to start."""
    for files in (BASE, CPU, ("docker-compose.gpu-host.yml",)):
        farm = {"ANIMASTOR_HOST_NAME": "gpu-1", "ANIMASTOR_DATABASE_URL": "postgresql://u:p@db/a",
                "ANIMASTOR_REDIS_URL": "redis://r:6379/0", "ANIMASTOR_ARTIFACT_URL": "s3://farm-bucket/p",
                "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}  # fmt: skip
        proc = run_compose("config", env={**SECRETS, **farm, "ANIMASTOR_PRESENCE_TTL_SECONDS": "20"}, files=files)
        assert proc.returncode == 0, proc.stderr
        checked = 0
        for name, block in services(proc.stdout).items():
            if "ANIMASTOR_PRESENCE_TTL_SECONDS" not in block:
                continue
            env = {k: v.strip("'\"") for k, v in environment(block).items()}
            settings = Settings.from_env(env)
            assert settings.silent_worker_seconds >= 2 * settings.presence_ttl_seconds, (files, name)
            checked += 1
        assert checked, f"no service of {files} passes ANIMASTOR_PRESENCE_TTL_SECONDS: nothing was checked"


# What a file sets itself: the stores' URLs from their passwords (one host), the artifacts' directory on its volume.
BUILT_IN_THE_FILE = {"ANIMASTOR_DATABASE_URL", "ANIMASTOR_REDIS_URL", "ANIMASTOR_ARTIFACT_ROOT"}


def settings_read() -> set[str]:
    """The variables `Settings.from_env` reads, and the tracing switch (worker/tracing.py) every process checks."""
    read = ("config.py", "worker/tracing.py")
    return {
        n for f in read for n in re.findall(r'"(ANIMASTOR_[A-Z0-9_]+)"', (ROOT / "animastor_tasks" / f).read_text())
    }


def test_every_setting_set_for_compose_reaches_every_process_and_the_grace_follows() -> None:
    """Set in `.env`, `ANIMASTOR_JOB_TIME_LIMIT` (which the files tell operators to raise together with the
    stop's grace period, itself fixed at 33 minutes) reached no container, nor did 18 other settings: long
    jobs were still killed at 1,900 s, on some hosts and not others where a file was patched by hand."""
    names = settings_read()
    assert {"ANIMASTOR_JOB_TIME_LIMIT", "ANIMASTOR_STAGES", "ANIMASTOR_DB_POOL_MAX", "ANIMASTOR_OTEL"} <= names
    farm = {"ANIMASTOR_HOST_NAME": "gpu-1", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    given = {name: f"set-{i}" for i, name in enumerate(sorted(names))}
    for files, workers in (
        (BASE, ("worker-audio", "worker-image")),
        (CPU, ("worker-audio-cpu", "worker-image-cpu")),
        (("docker-compose.gpu-host.yml",), ("worker-audio", "worker-image")),
    ):
        env = {**SECRETS, **farm, **given, "ANIMASTOR_STOP_GRACE_PERIOD": "50m"}
        proc = run_compose("config", env=env, files=files)
        assert proc.returncode == 0, proc.stderr
        blocks = services(proc.stdout)
        for name, block in blocks.items():
            if "animastor-tasks" not in block:
                continue  # Postgres, Redis
            seen = {k: v.strip("'\"") for k, v in environment(block).items()}
            wrong = {n: seen.get(n) for n in names - BUILT_IN_THE_FILE if seen.get(n) != given[n]}
            assert not wrong, (files, name, wrong)
        for name in workers:
            grace = re.search(r"^    stop_grace_period: (\S+)$", blocks[name], re.M)
            assert grace and seconds(grace.group(1)) == 50 * 60, (files, name, grace)


S3_STORE = {
    "ANIMASTOR_ARTIFACT_URL": "s3://farm-artifacts/prod",
    "AWS_ENDPOINT_URL_S3": "https://s3.example",
    "AWS_ACCESS_KEY_ID": "key-id",
    "AWS_SECRET_ACCESS_KEY": "key-secret",
    "AWS_DEFAULT_REGION": "eu-west-3",
}


@pytest.mark.parametrize("files", [BASE, CPU], ids=["base", "cpu"])
def test_an_s3_store_set_for_compose_gets_its_credentials_in_every_process(files: tuple[str, ...]) -> None:
    """The one-host files passed ANIMASTOR_ARTIFACT_URL=s3://... but none of the AWS_* variables boto3 reads: the
    store's endpoint, key pair and region never reached a container, and every job failed its upload."""
    proc = run_compose("config", env={**SECRETS, **S3_STORE}, files=files)
    assert proc.returncode == 0, proc.stderr
    checked = 0
    for name, block in services(proc.stdout).items():
        if "animastor-tasks" not in block:
            continue  # Postgres, Redis
        seen = {k: v.strip("'\"") for k, v in environment(block).items()}
        assert {k: seen.get(k) for k in S3_STORE} == S3_STORE, (files, name)
        checked += 1
    assert checked >= 7
    # Unset (the directory store, the default): nothing required, and no empty region (boto3 refuses one).
    proc = run_compose("config", env=SECRETS, files=files)
    assert proc.returncode == 0, proc.stderr
    for block in services(proc.stdout).values():
        region = environment(block).get("AWS_DEFAULT_REGION", "null") if "animastor-tasks" in block else "null"
        assert region.strip("'\"") != "", block
