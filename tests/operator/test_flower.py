"""Flower: refuses to start without auth, enforces basic auth, and shows our GPU workers and jobs in a browser."""

from __future__ import annotations

import os
import runpy
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from animastor_tasks.dev.net import free_port
from tests.support import missing, wait_for
from tests.support.stack import Stack

from . import http_get, make_book, operator_env

ROOT = Path(__file__).resolve().parents[2]
FLOWER_CONF = ROOT / "flowerconfig.py"
SCREENSHOTS = ROOT / "test-output"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def flower_options(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, object]:
    for key in list(os.environ):
        if key.startswith("ANIMASTOR_FLOWER_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return runpy.run_path(str(FLOWER_CONF))


def test_defaults_bind_loopback_with_basic_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    options = flower_options(monkeypatch, ANIMASTOR_FLOWER_BASIC_AUTH="ops:pa:ss,word")
    assert options["address"] == "127.0.0.1"
    assert options["port"] == 5555
    # One credential, kept whole: Flower would split a plain string on ','.
    assert options["basic_auth"] == ["ops:pa:ss,word"]


def test_address_and_port_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    options = flower_options(
        monkeypatch,
        ANIMASTOR_FLOWER_BASIC_AUTH="ops:secret-pw",
        ANIMASTOR_FLOWER_ADDRESS="0.0.0.0",
        ANIMASTOR_FLOWER_PORT="6000",
    )
    assert (options["address"], options["port"]) == ("0.0.0.0", 6000)


def test_dev_no_auth_is_allowed_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    options = flower_options(monkeypatch, ANIMASTOR_FLOWER_DEV_NO_AUTH="1")
    assert "basic_auth" not in options
    with pytest.raises(SystemExit):
        flower_options(monkeypatch, ANIMASTOR_FLOWER_DEV_NO_AUTH="1", ANIMASTOR_FLOWER_ADDRESS="0.0.0.0")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "set ANIMASTOR_FLOWER_BASIC_AUTH=user:password"),
        ({"ANIMASTOR_FLOWER_BASIC_AUTH": "no-colon-here"}, "must be 'user:password'"),
        ({"ANIMASTOR_FLOWER_BASIC_AUTH": ":only-a-password"}, "must be 'user:password'"),
        ({"ANIMASTOR_FLOWER_BASIC_AUTH": "ops:pw", "ANIMASTOR_FLOWER_PORT": "http"}, "not a port number"),
        (
            {"ANIMASTOR_FLOWER_DEV_NO_AUTH": "1", "ANIMASTOR_FLOWER_ADDRESS": "0.0.0.0"},
            "only on a loopback address",
        ),
    ],
)
def test_flower_refuses_to_start(tmp_path: Path, env: dict[str, str], expected: str) -> None:
    """The real command: a clear message on stderr and a non-zero exit, before any port is opened."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ANIMASTOR_FLOWER_", "FLOWER_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "animastor_tasks", "flower", f"--conf={FLOWER_CONF}"],
        env={**base, **env, "ANIMASTOR_FLOWER_PORT": env.get("ANIMASTOR_FLOWER_PORT", str(free_port()))},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "refusing to start Flower" in proc.stderr
    assert expected in proc.stderr
    assert "only-a-password" not in proc.stderr + proc.stdout  # the value itself is never echoed


@pytest.mark.parametrize(
    "flag",
    # Tornado strips any number of leading dashes: `-address=` and `---port=` slipped past a check for `--`.
    [["--address=0.0.0.0"], ["--port=80"], ["--basic-auth=ops:pw"], ["-address=0.0.0.0"], ["---port=80"]],
)
def test_flower_refuses_options_that_decide_who_reaches_it_on_the_command_line(tmp_path: Path, flag: list[str]) -> None:
    """Flower reads its command line after the --conf file: `--address=0.0.0.0` there opened an instance without
    auth (ANIMASTOR_FLOWER_DEV_NO_AUTH=1) on every interface, past the loopback rule."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ANIMASTOR_FLOWER_", "FLOWER_"))}
    env = {**base, "ANIMASTOR_FLOWER_DEV_NO_AUTH": "1", "ANIMASTOR_FLOWER_PORT": str(free_port())}
    for command in (
        [sys.executable, "-m", "celery", "-A", "animastor_tasks", "flower", f"--conf={FLOWER_CONF}", *flag],
        [sys.executable, "-m", "animastor_tasks.operator.cli", "flower", *flag],
    ):
        proc = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (command, proc.returncode, proc.stdout, proc.stderr)
        assert "refusing to start Flower" in proc.stderr and "ANIMASTOR_FLOWER_ADDRESS" in proc.stderr
        assert "ops:pw" not in proc.stderr + proc.stdout


def test_animastor_flower_refuses_a_conf_file_of_its_own(tmp_path: Path) -> None:
    """Flower keeps the last `--conf`: `animastor-tasks flower --conf=/dev/null` ran without the packaged settings,
    so without auth, on every interface, whatever the environment said."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ANIMASTOR_FLOWER_", "FLOWER_"))}
    env = {**base, "ANIMASTOR_FLOWER_BASIC_AUTH": "ops:pw", "ANIMASTOR_FLOWER_PORT": str(free_port())}
    command = [sys.executable, "-m", "animastor_tasks.operator.cli", "flower", "--conf=/dev/null"]
    proc = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "refusing to start Flower" in proc.stderr and "conf" in proc.stderr


@pytest.fixture
def flower_stack(tmp_path: Path) -> Iterator[tuple[Stack, str, tuple[str, str]]]:
    """Control + audio + image workers and Flower with basic auth; yields (stack, base URL, credentials)."""
    credentials = ("ops", secrets.token_urlsafe(16))
    with operator_env(tmp_path) as env:
        stack = Stack(env, tmp_path)
        try:
            port = free_port()
            stack.start_flower(port, {"ANIMASTOR_FLOWER_BASIC_AUTH": ":".join(credentials)})
            stack.start_control()
            stack.start_gpu("audio")
            stack.start_gpu("image")
            base = f"http://127.0.0.1:{port}/"
            wait_for(lambda: http_get(base + "healthcheck")[0] == 200, 60, "Flower /healthcheck")
            stack.wait_consumers("animastor.control", "gpu.audio", "gpu.image")
            yield stack, base, credentials
            log = stack.log_text()
            assert credentials[1] not in log, "the Flower password appeared in a log"
        finally:
            stack.close()


def run_book(stack: Stack) -> None:
    """A small book through the real control and GPU workers, until both commands complete."""
    from animastor_tasks.client import Client

    book = f"flower-{uuid.uuid4().hex[:6]}"
    stack.rt.catalog.import_book(make_book(book, scenes=2))
    client = Client(stack.settings, timeout=30)
    try:
        ids = [c["command_id"] for c in client.regenerate(book, ["all"])["commands"]]
    finally:
        client.close()

    def completed() -> bool:
        rows = stack.rt.ports.commands.commands(command_ids=ids)
        return len(rows) == 2 and all(r.status == "completed" for r in rows)

    wait_for(completed, 60, "both commands completed")


def test_flower_enforces_basic_auth(flower_stack: tuple[Stack, str, tuple[str, str]]) -> None:
    _, base, (user, password) = flower_stack
    for path in ("workers", "tasks", "api/workers"):
        assert http_get(base + path)[0] == 401, path
        assert http_get(base + path, (user, password + "x"))[0] == 401, path
        assert http_get(base + path, (user, password))[0] == 200, path
    assert http_get(base + "healthcheck")[0] == 200  # documented as internal: no auth


@pytest.mark.e2e
def test_browser_sees_gpu_workers_and_generate_tasks(flower_stack: tuple[Stack, str, tuple[str, str]]) -> None:
    """Headless Chromium logs into Flower and finds `audio@`, `image@` and `animastor.generate.*`."""
    from playwright import sync_api  # the dev extra

    if not Path(CHROMIUM).exists():
        missing(f"{CHROMIUM} is missing: apt-get install -y chromium")
    stack, base, (user, password) = flower_stack
    run_book(stack)
    SCREENSHOTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            anonymous = browser.new_context()
            assert anonymous.request.get(base + "workers").status == 401  # no credentials, no page
            anonymous.close()

            context = browser.new_context(
                http_credentials={"username": user, "password": password}, viewport={"width": 1400, "height": 900}
            )
            page = context.new_page()
            response = page.goto(base + "workers")
            assert response is not None and response.status == 200
            page.wait_for_selector("text=/audio@/", timeout=30_000)
            page.wait_for_selector("text=/image@/", timeout=30_000)
            page.wait_for_selector("text=/control@/", timeout=30_000)
            page.screenshot(path=str(SCREENSHOTS / "flower-workers.png"), full_page=True)

            response = page.goto(base + "tasks")
            assert response is not None and response.status == 200
            page.wait_for_selector("text=/animastor\\.generate\\.audio/", timeout=30_000)
            page.wait_for_selector("text=/animastor\\.generate\\.image/", timeout=30_000)
            page.screenshot(path=str(SCREENSHOTS / "flower-tasks.png"), full_page=True)
            context.close()
        finally:
            browser.close()
    assert (SCREENSHOTS / "flower-workers.png").stat().st_size > 10_000
    assert (SCREENSHOTS / "flower-tasks.png").stat().st_size > 10_000
