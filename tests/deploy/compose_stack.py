"""The compose stack on a real Docker engine, for tests/deploy/test_compose_stack.py.

Why a class of its own: every step goes through the containers (`docker-compose exec`), the stack must come
down with its volumes whatever happens, and the images it needs may have to be built here first
(deploy/standin/build.sh for the registry images, BuildKit for ours, with the host's CA bundle as a secret).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support import missing

ROOT = Path(__file__).resolve().parents[2]
FILES = ("docker-compose.yml", "docker-compose.cpu.yml")
IMAGE = "animastor-tasks:local"
#: What `up` starts with the CPU override, and what each must reach.
HEALTHY = ("postgres", "redis", "control", "beat", "worker-audio-cpu", "worker-image-cpu", "flower", "metrics")
ONE_SHOT = ("migrate",)
CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


def run(argv: Sequence[str], *, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


def require_docker() -> None:
    """Skip (fail under CI) unless a docker client and an engine that answers are here."""
    if shutil.which("docker") is None:
        missing("docker is not installed (apt-get install -y docker.io docker-compose)")
    probe = run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=60)
    if probe.returncode != 0:
        missing(f"no Docker daemon answers (start one: dockerd &): {probe.stderr.strip()[:200]}")


def compose_command() -> list[str]:
    if run(["docker", "compose", "version"], timeout=60).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    missing("no compose implementation (apt-get install -y docker-compose)")


def buildkit_command() -> tuple[list[str], dict[str, str]]:
    """A docker client that builds with BuildKit (the Dockerfile's RUN --mount needs it), and its env.

    Docker 23+ builds with BuildKit only through the buildx plugin; a 20.10 client (Debian's docker.io,
    /usr/bin/docker) has it built in and takes DOCKER_BUILDKIT=1.
    """
    candidates = [c for c in (shutil.which("docker"), "/usr/bin/docker") if c and os.access(c, os.X_OK)]
    for docker in dict.fromkeys(candidates):
        if run([docker, "buildx", "version"], timeout=60).returncode == 0:
            return [docker, "build"], {}
        version = run([docker, "version", "--format", "{{.Client.Version}}"], timeout=60).stdout.strip()
        if version.split(".")[0].isdigit() and int(version.split(".")[0]) < 23:
            return [docker, "build"], {"DOCKER_BUILDKIT": "1"}
    missing("no docker client builds with BuildKit: install the buildx plugin, or Debian's docker.io")


def ensure_registry_images() -> list[str]:
    """deploy/standin/build.sh: real images where they can be pulled, stand-ins where not; its report lines."""
    proc = run([str(ROOT / "deploy" / "standin" / "build.sh")], timeout=900, cwd=ROOT)
    if proc.returncode == 3:
        missing(f"stand-in images cannot be built here: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"deploy/standin/build.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return [line for line in proc.stdout.splitlines() if line.strip()]


def build_image() -> None:
    argv, env = buildkit_command()
    secret = next((["--secret", f"id=ca-bundle,src={p}"] for p in CA_BUNDLES if Path(p).is_file()), [])
    proc = run([*argv, *secret, "-t", IMAGE, "."], timeout=900, cwd=ROOT, env={**os.environ, **env})
    assert proc.returncode == 0, f"docker build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


class ComposeStack:
    """One compose project (its own name, ports and volumes) driven through the compose client."""

    def __init__(self, project: str, env: Mapping[str, str]) -> None:
        self.project = project
        self.compose = compose_command()
        base = {k: v for k, v in os.environ.items() if not k.startswith(("ANIMASTOR_", "COMPOSE_", "DOCKER_"))}
        self.env = {**base, **env}

    def __call__(
        self, *args: str, timeout: float = 180, stdin: str | None = None, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        files = [arg for f in FILES for arg in ("-f", str(ROOT / f))]
        return run(
            [*self.compose, *files, "-p", self.project, *args],
            timeout=timeout,
            cwd=ROOT,
            env={**self.env, **(env or {})},
            input=stdin,
        )

    def url(self, port_variable: str, path: str) -> str:
        """A published service on the host's loopback, by the variable that set its port."""
        return f"http://127.0.0.1:{self.env[port_variable]}{path}"

    def cli(self, *args: str, stdin: str | None = None, timeout: float = 120) -> Any:
        """`animastor-tasks ARGS --json` in the control container; its parsed output."""
        proc = self("exec", "-T", "control", "animastor-tasks", *args, "--json", stdin=stdin, timeout=timeout)
        assert proc.returncode == 0, f"animastor-tasks {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
        return json.loads(proc.stdout)

    def container(self, service: str) -> str:
        proc = self("ps", "-q", service)
        ids = proc.stdout.split()
        assert proc.returncode == 0 and ids, f"no container for {service}: {proc.stderr}"
        return ids[0]

    def inspect(self, container: str) -> dict[str, Any]:
        proc = run(["docker", "inspect", container])
        assert proc.returncode == 0, proc.stderr
        return dict(json.loads(proc.stdout)[0])

    def logs(self, *services: str, tail: int = 40) -> str:
        return self("logs", "--no-color", "--tail", str(tail), *services).stdout

    def wait_healthy(self, timeout: float) -> dict[str, str]:
        """Every long-running service healthy and every one-shot exited 0; their last states otherwise."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.states()
            done = [s for s in ONE_SHOT if states.get(s) == "exited 0"]
            failed = [s for s, st in states.items() if st.startswith("exited") and s not in done]
            broken = {s: st for s, st in states.items() if st == "unhealthy" or s in failed}
            assert not broken, f"services failed: {broken}\n{self.logs(*broken)}"
            if all(states.get(s) == "healthy" for s in HEALTHY) and len(done) == len(ONE_SHOT):
                return states
            time.sleep(1)
        raise AssertionError(f"not healthy within {timeout:.0f} s: {states}\n{self.logs(tail=20)}")

    def states(self) -> dict[str, str]:
        """service -> `healthy` / `starting` / `unhealthy`, `running` without a healthcheck, `exited N`."""
        proc = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}"])
        ids = proc.stdout.split()
        if not ids:
            return {}
        out: dict[str, str] = {}
        for item in json.loads(run(["docker", "inspect", *ids]).stdout):
            service = item["Config"]["Labels"].get("com.docker.compose.service", item["Name"])
            state = item["State"]
            if state["Status"] == "exited":
                out[service] = f"exited {state['ExitCode']}"
            else:
                out[service] = state.get("Health", {}).get("Status") or state["Status"]
        return out

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of the project that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {
            "containers": run(["docker", "ps", "-aq", "--filter", label]).stdout.split(),
            "networks": run(["docker", "network", "ls", "-q", "--filter", label]).stdout.split(),
            "volumes": run(["docker", "volume", "ls", "-q", "--filter", label]).stdout.split(),
        }
        return {kind: ids for kind, ids in found.items() if ids}

    def down(self) -> subprocess.CompletedProcess[str]:
        # -t 10: a GPU worker's 33-minute grace period is for deployments, not for a test's clean-up.
        return self("down", "-v", "--remove-orphans", "-t", "10", timeout=300)


def http_status(url: str, auth: tuple[str, str] | None = None) -> int:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text: `name{labels}` -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
