"""The systemd units shipped under deploy/systemd: a stop must be the worker's warm shutdown, and each
ExecStart must be a command line the CLI takes."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import click
import pytest

from animastor_tasks.config import Settings
from animastor_tasks.operator.cli import main

UNITS = sorted((Path(__file__).resolve().parents[2] / "deploy" / "systemd").glob("*.service"))


def _unit(path: Path) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read(path, encoding="utf-8")
    return parser["Service"]


def _seconds(value: str) -> float:
    units = {"": 1, "s": 1, "min": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)\s*(min|h|s|)", value))


def test_the_three_processes_have_a_unit() -> None:
    assert [u.name for u in UNITS] == [
        "animastor-beat.service",
        "animastor-control.service",
        "animastor-gpu-worker@.service",
    ]


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_a_stop_signals_the_main_process_alone(path: Path) -> None:
    """systemd's default KillMode (control-group) sends SIGTERM to every process of the unit: a Celery pool child
    dies on it, so `systemctl stop` killed the running GPU job although the docs promised a warm shutdown."""
    assert _unit(path)["KillMode"] == "mixed"


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_a_unit_runs_as_its_own_user_in_its_state_directory(path: Path) -> None:
    """The units ran every process as root with `/` as its working directory: a GPU job owned the host's files,
    and the default artifact directory (`artifacts`, relative) was `/artifacts`."""
    unit = _unit(path)
    assert unit.get("User") == "animastor" and unit.get("Group") == "animastor"
    assert unit.get("StateDirectory") == "animastor" and unit.get("WorkingDirectory") == "/var/lib/animastor"


@pytest.mark.parametrize("path", [u for u in UNITS if "beat" not in u.name], ids=lambda p: p.name)
def test_a_pool_child_the_kernel_kills_for_memory_stops_no_worker(path: Path) -> None:
    """systemd's default OOMPolicy (stop) stops the whole unit when the kernel's OOM killer kills one of its
    processes: a pool child killed with its job (which the worker runs again at once) took the worker and every
    other GPU of the host into a warm shutdown, idle until the slowest job ended. The main process killed so still
    ends the unit, and `Restart=on-failure` starts it again."""
    assert _unit(path).get("OOMPolicy") == "continue"


def test_a_gpu_worker_is_given_longer_than_a_job_may_run() -> None:
    gpu = _unit(next(u for u in UNITS if u.name.startswith("animastor-gpu-worker")))
    assert _seconds(gpu["TimeoutStopSec"]) > Settings().job_time_limit


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_exec_start_is_a_command_the_cli_takes(path: Path) -> None:
    argv = shlex.split(_unit(path)["ExecStart"].replace("%i", "audio").replace("%H", "gpu-host-1"))
    assert argv[0].endswith("/animastor-tasks")
    with click.Context(main) as ctx:
        command = main.get_command(ctx, argv[1])
        assert command is not None, argv
        parsed = command.make_context(argv[1], argv[2:], parent=ctx).params
    # Every option is the CLI's own (`worker` hands what it does not know to celery as it is).
    assert parsed.get("celery_args", ()) == (), parsed
    if "stage" in parsed:
        assert parsed["hostname"] in ("control@gpu-host-1", f"{parsed['stage']}@gpu-host-1"), parsed


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_a_setting_to_fix_is_not_restarted_for_ever(path: Path) -> None:
    """`Restart=on-failure` restarted a process that exited 2 (a setting to fix: a bad URL, an unknown stage)
    every 5 s for ever, its one line of why lost among the restarts; exit 3 (a store down) is still restarted."""
    unit = _unit(path)
    assert unit["Restart"] == "on-failure"
    assert "2" in unit.get("RestartPreventExitStatus", "").split(), unit.get("RestartPreventExitStatus")
    assert "3" not in unit.get("RestartPreventExitStatus", "").split()


def test_a_gpu_worker_killed_whole_is_started_again_before_its_stage_reads_as_without_a_worker() -> None:
    """Restarted 5 s after a kill (the OOM killer, a crash), with its start on top, a stage's only worker beat again
    after its heartbeat had lapsed (a TTL after its last beat, 4-6 s after the kill), and the tick BLOCKED the
    stage's commands for good (tests/e2e/test_worker_restart.py). A worker dying at each start is still left failed."""
    path = next(u for u in UNITS if u.name.startswith("animastor-gpu-worker"))
    gpu = _unit(path)
    assert _seconds(gpu["RestartSec"]) <= 1 < Settings().presence_ttl_seconds * 2 / 3
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(path, encoding="utf-8")
    unit = parser["Unit"]
    interval, burst = _seconds(unit["StartLimitIntervalSec"]), int(unit["StartLimitBurst"])
    assert 0 < interval / burst <= 6, "a worker that runs 6 s or more between its starts is never left failed"
