"""Every CLI command refuses a bad `ANIMASTOR_OTEL` as workers and beat do, and says in `--help` what each command
and option takes."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from animastor_tasks.operator import process_commands
from animastor_tasks.operator.cli import main
from tests.unit.test_cli_input import NOWHERE


@pytest.fixture(autouse=True)
def _no_local_stores(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ANIMASTOR_LOCAL_DIR", str(tmp_path / "none"))


@pytest.mark.parametrize(
    "argv",
    [
        ["queues", "--json"],
        ["status", "b1"],
        ["cancel", "b1", "--timeout", "1"],
        ["metrics", "--port", "0"],
        ["worker"],
        ["beat"],
    ],
)
def test_a_tracing_switch_other_than_0_or_1_stops_every_command(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ANIMASTOR_OTEL=2` stopped workers and beat (exit 2) while `queues` answered and `metrics` served on."""
    started: list[tuple[str, ...]] = []
    monkeypatch.setattr(process_commands, "_exec_celery", lambda *args: started.append(args))
    result = CliRunner().invoke(main, argv, env={**NOWHERE, "ANIMASTOR_OTEL": "2"})
    assert result.exit_code == 2 and started == [], result.output
    assert result.output == "error: ANIMASTOR_OTEL='2' must be 1 (trace) or 0 (off)\n"


def test_layers_show_says_what_it_does() -> None:
    """`layers --help` listed `show` with no description, and `layers show --help` had none either."""
    listed = CliRunner().invoke(main, ["layers", "--help"], env=NOWHERE)
    [line] = [line for line in listed.output.splitlines() if line.strip().startswith("show")]
    assert line.strip() != "show", listed.output
    result = CliRunner().invoke(main, ["layers", "show", "--help"], env=NOWHERE)
    assert "every stage's layer" in result.output.partition("Options:")[0], result.output


def test_cancel_reason_help_gives_the_rules_the_task_applies() -> None:
    """`--reason` had no help: a reason of two lines, or with a tab, was refused by the control worker unannounced."""
    result = CliRunner().invoke(main, ["cancel", "--help"], env=NOWHERE)
    reason = " ".join(result.output.partition("--reason TEXT")[2].partition("--timeout")[0].split())
    for rule in ("one line", "at most 1,000 characters", "no control character", "bidi control"):
        assert rule in reason, result.output
