"""Flower started by Celery's own command line keeps the auth rule, whatever directory it runs in.

*Why:* `celery -A animastor_tasks flower` read `./flowerconfig.py` only where there was one, and Flower silently
ran without it: from any other directory (an installed package, the image, which had no flowerconfig.py) it came
up with no authentication on every interface.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from animastor_tasks.dev.net import free_port
from animastor_tasks.worker import flower_settings

ROOT = Path(__file__).resolve().parents[2]
REFUSAL = "refusing to start Flower"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANIMASTOR_FLOWER_", "FLOWER_"))}
    # Should an unguarded Flower start anyway, it listens on loopback only, on a port of its own.
    return {**env, "FLOWER_ADDRESS": "127.0.0.1", "FLOWER_PORT": str(free_port("127.0.0.1")), **extra}


def test_celery_s_flower_command_refuses_without_auth_from_any_directory(tmp_path: Path) -> None:
    celery = Path(sys.executable).with_name("celery")
    proc = subprocess.Popen(
        [str(celery), "-A", "animastor_tasks", "flower"],
        cwd=tmp_path,  # no flowerconfig.py here
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=15)  # refused, it exits in a second or two
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("Flower started without authentication")
    assert proc.returncode == 2 and REFUSAL in err, err


def _under(command: str, monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """`guard_flower_command()` as the app's load calls it, inside Celery's group context about to run `command`."""
    for key in list(os.environ):
        if key.startswith("ANIMASTOR_FLOWER_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["celery", "-A", "animastor_tasks", command])
    ctx = click.Context(click.Group("celery"))
    ctx.invoked_subcommand = command
    with ctx:
        flower_settings.guard_flower_command()


def test_the_guard_refuses_a_flower_without_auth(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        _under("flower", monkeypatch)
    assert info.value.code == 2 and REFUSAL in capsys.readouterr().err


def test_the_guard_makes_the_packaged_settings_flower_s_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    import flower.options  # noqa: F401
    from tornado.options import options

    before = options.conf
    try:
        _under("flower", monkeypatch, ANIMASTOR_FLOWER_BASIC_AUTH="ops:pw")
        assert options.conf == flower_settings.conf_path()
    finally:
        options.conf = before


def test_the_guard_leaves_every_other_command_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _under("worker", monkeypatch)  # no auth, no refusal: not Flower
    flower_settings.guard_flower_command()  # no click context at all (the app imported by a test, the CLI)


def test_the_image_carries_the_flower_settings() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = [line for line in dockerfile.splitlines() if line.startswith("COPY ")]
    assert any("flowerconfig.py" in line.split() for line in copied)
    assert "FLOWER_CONF=/app/flowerconfig.py" in dockerfile


@pytest.mark.parametrize("address", ["not an address", "999.1.1.1", "192.0.2.10"])  # the last resolves, not here
def test_an_address_flower_cannot_listen_on_is_refused_before_it_starts(address: str) -> None:
    """Flower itself failed on it with a socket.gaierror traceback (exit 1); the metrics exporter already refused."""
    env = {"ANIMASTOR_FLOWER_ADDRESS": address, "ANIMASTOR_FLOWER_BASIC_AUTH": "ops:pw"}
    with pytest.raises(flower_settings.Refused, match=f"ANIMASTOR_FLOWER_ADDRESS='{address}' is no address"):
        flower_settings.flower_options(env)
    assert flower_settings.flower_options({**env, "ANIMASTOR_FLOWER_ADDRESS": "0.0.0.0"})["address"] == "0.0.0.0"
