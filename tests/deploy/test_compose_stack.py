"""The compose stack, deployed for real: docker-compose.yml with the CPU override on a real Docker engine.

It comes up healthy (beat included), does the work through the containers (migrate, import the sample book,
regenerate every stage, every pair ready with its artifact), Flower asks for its credentials, the exporter's
numbers move; a GPU worker stopped while its job runs finishes the job first (warm shutdown inside the
grace period); `down -v` leaves nothing. Images that no registry serves here are stand-ins that
deploy/standin/build.sh builds from Debian packages: the output says which.

Outside CI the tests skip, saying why, when docker or its engine is missing; under CI=true they fail.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from animastor_tasks.dev.net import free_port
from tests.deploy.compose_stack import (
    IMAGE,
    ROOT,
    ComposeStack,
    build_image,
    ensure_registry_images,
    http_status,
    require_docker,
    scrape,
)
from tests.support import wait_for

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(900)]

BOOK = "lighthouse-keeper"
SAMPLE = ROOT / "animastor_tasks" / "dev" / "data" / "sample_book.json"
FLOWER_AUTH = ("ops", "flower-" + uuid.uuid4().hex[:8])
AUDIO_STAGE = {"queue": "gpu.audio", "input": "text", "media_type": "audio/wav"}
IMAGE_STAGE = {"queue": "gpu.image", "input": "prompt", "media_type": "image/png"}
#: An audio job of 20 s: it outlasts Docker's default 10 s stop timeout by far.
SLOW_JOB = {"steps": 40, "step_seconds": 0.5}
DOCKER_DEFAULT_STOP_SECONDS = 10
GRACE_SECONDS = 33 * 60  # stop_grace_period of the GPU workers


@pytest.fixture(scope="module")
def stack(figure: Callable[[str], None]) -> Iterator[ComposeStack]:
    require_docker()
    started = time.monotonic()
    for line in ensure_registry_images():
        figure(line)
    t = time.monotonic()
    build_image()
    figure(f"images: registry images ready in {t - started:.1f} s, {IMAGE} built in {time.monotonic() - t:.1f} s")

    ports = {"ANIMASTOR_FLOWER_PORT": str(free_port()), "ANIMASTOR_METRICS_PORT": str(free_port())}
    env = {
        "POSTGRES_PASSWORD": "pg-" + uuid.uuid4().hex[:12],
        "REDIS_PASSWORD": "redis-" + uuid.uuid4().hex[:12],
        "ANIMASTOR_FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH),
        "ANIMASTOR_STAGES": json.dumps({"audio": AUDIO_STAGE, "image": IMAGE_STAGE}),
        "ANIMASTOR_TICK_SECONDS": "2",
        **ports,
    }
    project = f"animastor-deploy-{uuid.uuid4().hex[:8]}"
    compose = ComposeStack(project, env)
    try:
        t = time.monotonic()
        up = compose("up", "-d", "--no-build", timeout=300)
        assert up.returncode == 0, f"up failed:\n{up.stdout}\n{up.stderr}"
        states = compose.wait_healthy(timeout=240)
        figure(f"compose: every service healthy {time.monotonic() - t:.1f} s after `up -d` ({len(states)} services)")
        yield compose
    finally:
        compose.down()  # also when a test or the start failed; test_down_leaves_nothing asserts it
        if left := compose.leftovers():
            figure(f"compose: LEFT BEHIND after down -v: {left}")
        figure(f"compose: whole deployment test (images, up, work, warm stop, down) {time.monotonic() - started:.1f} s")


def _metrics(stack: ComposeStack) -> dict[str, float]:
    return scrape(stack.url("ANIMASTOR_METRICS_PORT", "/metrics"))


def _jobs(stack: ComposeStack, event: str, stage: str | None = None) -> float:
    """animastor_jobs_total for one event, over every stage or one."""
    return sum(
        value
        for name, value in _metrics(stack).items()
        if name.startswith("animastor_jobs_total{")
        and f'event="{event}"' in name
        and (stage is None or f'stage="{stage}"' in name)
    )


def _if_all_ready(status: dict[str, Any]) -> dict[str, Any] | None:
    """The status when every command completed and every pair is ready with its artifact, else None."""
    cells = [cell for scene in status["scenes"] for cell in scene["stages"].values()]
    done = all(c["status"] == "completed" for c in status["commands"])
    return status if done and all(c["state"] == "ready" and c["artifact_uri"] for c in cells) else None


def test_the_stack_does_the_work(stack: ComposeStack, figure: Callable[[str], None]) -> None:
    migrate = stack("exec", "-T", "control", "animastor-tasks", "db", "migrate")
    assert migrate.returncode == 0, migrate.stderr
    assert stack.states()["migrate"] == "exited 0"

    imported = stack.cli("book", "import", "-", stdin=SAMPLE.read_text())
    assert imported["book_id"] == BOOK and imported["scenes_added"] == 20, imported
    before = _jobs(stack, "ready")

    t = time.monotonic()
    sent = stack.cli("regenerate", BOOK, "--stage", "all")
    assert sorted(c["stage"] for c in sent["commands"]) == ["audio", "image"], sent
    status = wait_for(lambda: _if_all_ready(stack.cli("status", BOOK)), 240, "every pair ready", 1.0)
    figure(f"work: 20 scenes x 2 stages ready {time.monotonic() - t:.1f} s after regenerate --stage all")

    uris = [cell["artifact_uri"] for scene in status["scenes"] for cell in scene["stages"].values()]
    paths = [u.removeprefix("file://") for u in uris]
    check = (
        "import sys; heads = [open(p, 'rb').read(8) for p in sys.argv[1:]]; "
        "sys.exit(0 if all(h[:4] == b'RIFF' or h == b'\\x89PNG\\r\\n\\x1a\\n' for h in heads) else 1)"
    )
    found = stack("exec", "-T", "worker-audio-cpu", "python", "-c", check, *paths)
    assert found.returncode == 0, f"artifacts missing or not WAV/PNG in the artifacts volume: {found.stderr}"

    # Redis runs as its own user, not root (the compose file's `sh -c` once ran it as root).
    uid = stack("exec", "-T", "redis", "awk", "/^Uid:/ {print $2}", "/proc/1/status")
    assert uid.returncode == 0 and uid.stdout.strip() not in ("", "0"), (uid.stdout, uid.stderr)

    workers = stack.url("ANIMASTOR_FLOWER_PORT", "/api/workers")
    assert http_status(workers) == 401
    assert http_status(workers, auth=FLOWER_AUTH) == 200
    assert http_status(workers, auth=("ops", "wrong")) == 401

    after = wait_for(lambda: n if (n := _jobs(stack, "ready")) >= before + 40 else None, 30, "ready jobs counted")
    samples = _metrics(stack)
    assert samples['animastor_store_up{store="postgres"}'] == 1.0
    assert samples['animastor_store_up{store="broker"}'] == 1.0
    figure(f"metrics: animastor_jobs_total{{event=ready}} moved {before:.0f} -> {after:.0f}")


def test_a_gpu_worker_stopped_mid_job_finishes_it(stack: ComposeStack, figure: Callable[[str], None]) -> None:
    stack.cli("book", "import", "-", stdin=SAMPLE.read_text())  # idempotent: the book is there either way
    # The same worker with a slow builtin job (a redeploy with new settings is when workers get stopped).
    slow = json.dumps({"audio": {**AUDIO_STAGE, "params": SLOW_JOB}, "image": IMAGE_STAGE})
    up = stack("up", "-d", "--no-deps", "--no-build", "worker-audio-cpu", env={"ANIMASTOR_STAGES": slow})
    assert up.returncode == 0, up.stderr
    container = stack.container("worker-audio-cpu")
    node = f"audio@{stack.inspect(container)['Config']['Hostname']}"
    assert stack.inspect(container)["Config"]["StopTimeout"] == GRACE_SECONDS

    def consuming() -> bool:
        queues = stack.cli("queues")
        return any(c["hostname"] == node for q in queues if q["stage"] == "audio" for c in q["consumers"])

    wait_for(consuming, 90, f"{node} consuming gpu.audio", 1.0)
    started = _jobs(stack, "started", "audio")
    sent = stack.cli("regenerate", BOOK, "--stage", "audio", "--scene", "ch1/s1")
    command = sent["commands"][0]["command_id"]
    # Started on the worker (the exporter counts job starts), not merely dispatched to its queue.
    wait_for(lambda: _jobs(stack, "started", "audio") > started, 60, "the slow job started", 0.3)
    t = time.monotonic()
    stopped = stack("stop", "worker-audio-cpu", timeout=GRACE_SECONDS + 60)  # no -t: the service's grace period
    took = time.monotonic() - t
    assert stopped.returncode == 0, stopped.stderr
    state = stack.inspect(container)["State"]
    logs = stack.logs("worker-audio-cpu", tail=60)
    assert state["ExitCode"] == 0, f"killed, not a warm shutdown: {state}\n{logs}"
    assert "Warm shutdown" in logs, logs
    status = stack.cli("status", BOOK)
    mine = next(c for c in status["commands"] if c["command_id"] == command)
    cell = status["scenes"][0]["stages"]["audio"]
    assert mine["status"] == "completed" and mine["progress"]["ready"] == 1, f"{mine}\n{logs}"
    assert cell["state"] == "ready" and cell["artifact_uri"], cell
    assert DOCKER_DEFAULT_STOP_SECONDS < took < GRACE_SECONDS, took
    job_seconds = SLOW_JOB["steps"] * SLOW_JOB["step_seconds"]
    figure(
        f"warm stop: worker-audio-cpu stopped {took:.1f} s after SIGTERM; its {job_seconds:.0f} s job finished"
        " and its pair is ready (Docker's default stop timeout would have killed it at 10 s)"
    )


def test_down_leaves_nothing(stack: ComposeStack, figure: Callable[[str], None]) -> None:
    t = time.monotonic()
    down = stack.down()
    assert down.returncode == 0, down.stderr
    assert stack.leftovers() == {}, stack.leftovers()
    figure(f"down -v: nothing of the project left ({time.monotonic() - t:.1f} s)")
