"""`animastor-tasks demo` as a user runs it: the story completes fast, no secret reaches any output or log, and
nothing it started survives it, whether it finishes, gets Ctrl-C (SIGINT) or SIGTERM."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from animastor_tasks.dev.net import free_port
from animastor_tasks.dev.processes import leftovers
from tests.operator import http_get, operator_env
from tests.support import wait_for

DEMO_DEADLINE = 60.0  # the issue asks for a demo under about a minute


class DemoRun:
    """The demo as a subprocess in a session of its own, its output collected line by line."""

    def __init__(self, env: dict[str, str], run_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.lines: list[str] = []
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "animastor_tasks.operator.cli", "demo", "--run-dir", str(run_dir), *args],
            env={**env, "COLUMNS": "160"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float = 60) -> None:
        wait_for(
            lambda: re.search(pattern, self.output) or self.proc.poll() is not None, timeout, f"demo prints {pattern!r}"
        )
        assert self.proc.poll() is None, f"the demo exited before printing {pattern!r}:\n{self.output}"

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"the demo did not exit within {timeout:.0f}s:\n{self.output}") from None
        self._reader.join(timeout=10)
        return code

    def token(self) -> str:
        found = re.search(r"supervisor token ([0-9a-f]+)", self.output)
        assert found, self.output
        return found.group(1)

    def assert_nothing_survives(self) -> None:
        """No live process in the demo's group or any group it announced, none with its supervisor token."""
        groups = [self.proc.pid, *groups_in(self.output)]
        assert len(groups) > 1, f"the demo announced no process group:\n{self.output}"
        left = leftovers(self.token(), groups)
        if left:  # give a process killed a moment ago the time to leave /proc
            time.sleep(1)
            left = leftovers(self.token(), groups)
        described = {pid: _cmdline(pid) for pid in left}
        self.kill_leftovers()
        assert not left, f"processes survived the demo: {described}\n{self.output}"

    def kill_leftovers(self) -> None:
        """The test's own cleanup: SIGKILL whatever the demo left (its groups, its token), by pid."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        found = re.search(r"supervisor token ([0-9a-f]+)", self.output)
        for pid in leftovers(found.group(1) if found else "-", groups_in(self.output)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def groups_in(output: str) -> list[int]:
    """Process groups the demo announced (`... (process group N) ...`)."""
    return [int(n) for n in re.findall(r"process group (\d+)", output)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def logs(run_dir: Path) -> dict[str, str]:
    return {p.name: p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.log"))}


def with_password(url: str) -> tuple[str, str | None]:
    """The database URL with a password in it when the server accepts one (trust auth ignores it)."""
    parts = urlsplit(url)
    if parts.password:
        return url, parts.password
    if not parts.hostname:
        return url, None  # a Unix socket (local embedded server): no password to put in a URL
    password = f"pw{secrets.token_hex(8)}"
    netloc = f"{parts.username or 'postgres'}:{password}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    candidate = urlunsplit(parts._replace(netloc=netloc))
    try:
        psycopg.connect(candidate, connect_timeout=3).close()
    except psycopg.Error:
        return url, None
    return candidate, password


@pytest.fixture
def demo_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    with operator_env(
        tmp_path,
        ANIMASTOR_FLOWER_PORT=str(free_port()),
        ANIMASTOR_METRICS_PORT=str(free_port()),
    ) as env:
        env.pop("ANIMASTOR_STAGES")  # the demo's own stage table
        yield env


def test_demo_tells_the_story_fast_and_leaves_nothing(demo_env: dict[str, str], tmp_path: Path) -> None:
    flower_password = secrets.token_urlsafe(16)
    api_key = f"sk-{secrets.token_hex(12)}"
    database_url, db_password = with_password(demo_env["ANIMASTOR_DATABASE_URL"])
    env = {
        **demo_env,
        "ANIMASTOR_DATABASE_URL": database_url,
        "ANIMASTOR_FLOWER_BASIC_AUTH": f"ops:{flower_password}",
        "ANIMASTOR_INFERENCE_API_KEY": api_key,
    }
    run = DemoRun(env, tmp_path / "run")
    try:
        code = run.finish(timeout=120)
        took = time.monotonic() - run.started
        run.assert_nothing_survives()  # checked before anything of ours could clean up
    except BaseException:
        run.kill_leftovers()
        raise
    out = run.output
    assert code == 0, out
    assert took < DEMO_DEADLINE, f"the demo took {took:.1f}s\n{out}"

    # The story, in order.
    story = [
        r"using postgresql://",
        r"started control worker: pid \d+",
        r"started audio worker",
        r"started image worker",
        r"started beat",
        r"started flower",
        r"imported 'lighthouse-keeper' .*20 scenes",
        r"regenerate lighthouse-keeper --stage all",
        r"audio: completed, 20/20 ready",
        r"image: completed, 20/20 ready",
        r"\(image\): BLOCKED reason=no_worker:image",
        r"how to fix: start a worker for the stage \(`animastor-tasks worker --stage image`\)",
        r"slow generator",
        r"cancel lighthouse-keeper",
        r"cancelled \d+ command\(s\)",
        r"audio after Stop All: dirty=\d+, ready=\d+",
        r"artifacts +\S+",
        r"Flower +http://127\.0\.0\.1:\d+/ \(basic auth: ANIMASTOR_FLOWER_BASIC_AUTH",
        r"metrics +http://127\.0\.0\.1:\d+/metrics",
        r"all \d+ process groups stopped; nothing left running",
    ]
    position = 0
    for step in story:
        found = re.compile(step).search(out, position)
        assert found, f"missing (or out of order): {step!r}\n{out}"
        position = found.end()
    files = re.search(r"artifacts .*\((\d+) files", out)
    assert files and int(files.group(1)) >= 40, out  # 20 scenes x 2 stages

    # Logs: one line per event with its component prefix, and no secret anywhere.
    texts = {"demo output": out, **logs(run.run_dir)}
    joined = "\n".join(texts.values())
    for prefix in ("[DISPATCH]", "[GENERATE]", "[COMMAND]", "[WORKER]"):
        assert prefix in joined, f"no {prefix} line in the logs"
    secrets_used = {"flower password": flower_password, "API key": api_key}
    if db_password is not None:
        secrets_used["database password"] = db_password
        assert "postgresql://postgres:***@" in out  # the URL is shown, its password hidden
    for what, secret in secrets_used.items():
        for name, text in texts.items():
            assert secret not in text, f"the {what} appears in {name}"


@pytest.mark.parametrize(
    ("sig", "after"),
    [
        (signal.SIGINT, r"regenerate lighthouse-keeper --stage all"),  # Ctrl-C with jobs in flight
        (signal.SIGTERM, r"started flower"),  # while processes are still starting
    ],
    ids=["sigint-mid-run", "sigterm-during-start"],
)
def test_a_signal_stops_every_process_it_started(
    demo_env: dict[str, str], tmp_path: Path, sig: signal.Signals, after: str
) -> None:
    run = DemoRun(demo_env, tmp_path / "run")
    try:
        run.wait_for_line(after)
        os.kill(run.proc.pid, sig)
        code = run.finish(timeout=60)
        run.assert_nothing_survives()  # checked before anything of ours could clean up
    except BaseException:
        run.kill_leftovers()
        raise
    out = run.output
    assert code == 128 + sig, out
    assert f"{sig.name} received: stopping everything this demo started" in out
    assert "nothing left running" in out
    # The generated Flower password stays in its 0600 file: never in the output or a log.
    credentials = run.run_dir / "flower-credentials"
    assert credentials.stat().st_mode & 0o077 == 0
    password = credentials.read_text().strip().partition(":")[2]
    assert len(password) >= 16
    for name, text in {"demo output": out, **logs(run.run_dir)}.items():
        assert password not in text, f"the generated Flower password appears in {name}"


def test_keep_running_leaves_the_stack_up_until_ctrl_c(demo_env: dict[str, str], tmp_path: Path) -> None:
    run = DemoRun(demo_env, tmp_path / "run", "--keep-running")
    try:
        run.wait_for_line(r"--keep-running: the stack stays up", timeout=90)
        flower = re.search(r"Flower +(http://\S+)", run.output)
        metrics = re.search(r"metrics +(http://\S+)", run.output)
        assert flower and metrics, run.output
        time.sleep(2)  # still up a moment later: nothing exits on its own
        assert run.proc.poll() is None
        assert http_get(flower.group(1) + "healthcheck")[0] == 200
        assert http_get(flower.group(1) + "workers")[0] == 401
        user, _, password = (run.run_dir / "flower-credentials").read_text().strip().partition(":")
        status, page = http_get(flower.group(1) + "workers", (user, password))
        assert status == 200 and "Flower" in page
        assert http_get(metrics.group(1))[0] == 200
        os.kill(run.proc.pid, signal.SIGINT)
        code = run.finish(timeout=60)
        run.assert_nothing_survives()
    except BaseException:
        run.kill_leftovers()
        raise
    assert code == 130, run.output
