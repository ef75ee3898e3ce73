"""The package as a user installs it: a wheel built with `python -m build`, installed into a fresh virtual
environment, run from a directory outside the source tree: the commands answer and `animastor-tasks demo`
tells its whole story (workers, beat, Flower with its packaged settings, the metrics exporter).

Why a copy of the tree is built, not the checkout: a build writes `build/` and `*.egg-info` next to the
sources, and a copy of the tracked files is also what a fresh clone gives; the wheel must not need more.
The venv is built once per test session (pip may take the dependencies from its cache or the index).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from animastor_tasks.dev.net import free_port
from animastor_tasks.dev.processes import leftovers
from tests.operator import operator_env
from tests.support import missing

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
NOT_SHIPPED = (
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".animastor-local",
    "test-output",
)


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    outside: Path  # a working directory outside the source tree, with nothing of it around
    timings: dict[str, float]

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a user of the venv has: its bin first on PATH, nothing pointing at the checkout."""
        base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        return {**base, **(extra or {}), "PATH": f"{self.bin}{os.pathsep}{base.get('PATH', '')}", "COLUMNS": "120"}

    def run(
        self, *argv: str, env: Mapping[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / argv[0]), *argv[1:]],
            env=env or self.env(),
            cwd=self.outside,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def timed(timings: dict[str, float], name: str, argv: list[str], cwd: Path, timeout: float) -> None:
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    timings[name] = time.monotonic() - started
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """`python -m build --wheel` of a copy of the tree, installed with pip into a fresh venv (once a session)."""
    base = tmp_path_factory.mktemp("wheel")
    source, dist, venv, outside = base / "source", base / "dist", base / "venv", base / "elsewhere"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SHIPPED))
    outside.mkdir()
    timings: dict[str, float] = {}
    timed(timings, "build", [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(source)], base, 600)
    wheels = sorted(dist.glob("animastor_tasks-*.whl"))
    assert len(wheels) == 1, wheels
    timed(timings, "venv", [sys.executable, "-m", "venv", str(venv)], base, 300)
    timed(
        timings, "pip install", [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheels[0])], base, 900
    )
    shutil.rmtree(source)  # nothing of the sources left to fall back on
    print(f"\nwheel {wheels[0].name}: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
    return Installed(wheels[0], venv, outside, timings)


def newer_python() -> Path | None:
    """The newest Python newer than this one: `python3.N` on PATH, else among pyenv's versions (whose shims
    answer only for the version pyenv has selected)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for minor in range(20, sys.version_info.minor, -1):
        found = [shutil.which(f"python3.{minor}")]
        found += [str(p) for p in sorted(pyenv.glob(f"3.{minor}.*/bin/python3.{minor}"), reverse=True)]
        for candidate in filter(None, found):
            check = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[1])"], capture_output=True)
            if check.returncode == 0 and check.stdout.strip() == str(minor).encode():
                return Path(candidate)
    return None


@pytest.fixture(scope="session")
def installed_newest(installed: Installed, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The same wheel installed into a venv of the newest Python found (3.11+ is what the package asks for)."""
    python = newer_python()
    if python is None:
        missing(f"no Python newer than 3.{sys.version_info.minor} found (python3.N on PATH or pyenv's versions)")
    base = tmp_path_factory.mktemp("wheel-newest")
    venv, outside = base / "venv", base / "elsewhere"
    outside.mkdir()
    timings: dict[str, float] = {}
    timed(timings, "venv", [str(python), "-m", "venv", str(venv)], base, 300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(installed.wheel)]
    timed(timings, "pip install", pip, base, 900)
    print(f"\n{installed.wheel.name} on {python}: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
    return Installed(installed.wheel, venv, outside, timings)


def test_the_commands_exit_at_once_on_the_newest_python(installed_newest: Installed, tmp_path: Path) -> None:
    """On Python 3.13 a command that left its Postgres pool open waited 5 s for each of the pool's threads on its
    way out: every command that touched the database took 20 s more."""
    book = ROOT / "animastor_tasks" / "dev" / "data" / "sample_book.json"
    with operator_env(tmp_path) as env:
        for argv in (["book", "import", str(book)], ["status", "lighthouse-keeper", "--json"], ["commands", "--json"]):
            started = time.monotonic()
            proc = installed_newest.run("animastor-tasks", *argv, env=installed_newest.env(env))
            took = time.monotonic() - started
            shown = " ".join(argv)
            print(f"$ animastor-tasks {shown}  (on {installed_newest.venv}: exit {proc.returncode}, {took:.2f}s)")
            assert proc.returncode == 0, proc.stderr
            assert "couldn't stop thread" not in proc.stderr, proc.stderr
            assert took < 5, f"{took:.1f}s to answer and exit"


def test_the_installed_commands_answer_from_outside_the_tree(installed: Installed) -> None:
    where = installed.run(
        "python",
        "-c",
        "import animastor_tasks, celeryconfig, importlib.resources as r; "
        "from animastor_tasks.worker import flower_settings as f; "
        "print(animastor_tasks.__file__); print(celeryconfig.__file__); print(f.conf_path()); "
        "print(r.files('animastor_tasks').joinpath('py.typed').is_file())",
    )
    assert where.returncode == 0, where.stderr
    lines = where.stdout.split()
    site = installed.venv / "lib"
    assert all(Path(p).is_relative_to(site) for p in lines[:3]), (lines, "imported from outside the venv")
    assert lines[3] == "True", "py.typed is not installed"
    print("\n".join(lines))

    for argv in (["--help"], ["flower", "--help"], ["worker", "--help"], ["beat", "--help"], ["up", "--help"]):
        proc = installed.run("animastor-tasks", *argv)
        print(f"$ animastor-tasks {' '.join(argv)}  (exit {proc.returncode})\n{proc.stdout}")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("Usage: animastor-tasks"), proc.stdout
    top = installed.run("animastor-tasks", "--help").stdout
    for command in ("demo", "flower", "worker", "beat", "up", "metrics", "regenerate"):
        assert re.search(rf"^  {command} ", top, re.M), f"{command} missing from --help"

    # Flower's auth rules come with the package: no credentials, no Flower (exit status 2, said why).
    env = {k: v for k, v in installed.env().items() if not k.startswith(("ANIMASTOR_FLOWER_", "FLOWER_"))}
    refused = installed.run("animastor-tasks", "flower", env=env)
    print(f"$ animastor-tasks flower  (no credentials; exit {refused.returncode})\n{refused.stderr}")
    assert refused.returncode == 2 and "refusing to start Flower" in refused.stderr, refused


def survivors(output: str) -> list[int]:
    """Processes the demo started that are still alive (killed here, by pid, and reported)."""
    token = re.search(r"supervisor token ([0-9a-f]+)", output)
    groups = [int(n) for n in re.findall(r"process group (\d+)", output)]
    left = leftovers(token.group(1), groups) if token else []
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


@pytest.fixture
def demo_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    with operator_env(tmp_path, ANIMASTOR_FLOWER_PORT=str(free_port()), ANIMASTOR_METRICS_PORT=str(free_port())) as env:
        env.pop("ANIMASTOR_STAGES")  # the demo's own stage table
        yield env


def test_the_demo_runs_to_the_end_from_the_wheel(
    installed: Installed, demo_env: dict[str, str], tmp_path: Path
) -> None:
    run_dir = tmp_path / "demo-run"
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(installed.bin / "animastor-tasks"), "demo", "--run-dir", str(run_dir)],
        env=installed.env(demo_env),
        cwd=installed.outside,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out = True
    took = time.monotonic() - started
    left = survivors(out)
    print(f"\n$ animastor-tasks demo  (from the wheel, in {installed.outside}; exit {proc.returncode}, {took:.1f}s)")
    print(out)
    assert not timed_out, "the demo did not finish within 240s"
    assert proc.returncode == 0, out
    assert not left, f"processes survived the demo: {left}"
    for step in (
        r"started flower",
        r"audio: completed, 20/20 ready",
        r"\(image\): BLOCKED reason=no_worker:image",
        r"Flower +http://127\.0\.0\.1:\d+/",
        r"all \d+ process groups stopped; nothing left running",
    ):
        assert re.search(step, out), f"missing {step!r}"
    # Flower came up on the packaged settings (no flowerconfig.py anywhere around it).
    flower_log = (run_dir / "logs" / "flower.log").read_text()
    assert "Visit me at http://127.0.0.1:" in flower_log, flower_log[-2000:]
