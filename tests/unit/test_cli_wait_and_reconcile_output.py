"""What the CLI says when a regenerate's wait is cut short by Ctrl-C, and `reconcile`'s report for people."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from animastor_tasks.operator import cli


def test_ctrl_c_during_a_regenerate_wait_says_how_to_resend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request may be queued already: a retry with a new id would be a second command. Ctrl-C printed only
    click's `Aborted!`, without the --command-id a resend needs."""
    from animastor_tasks.client import Client

    def interrupted(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Client, "regenerate", interrupted)
    command_id = "0b6f2a4e-8a0f-4c57-9d43-5b1c2f0d9e11"
    argv = ["regenerate", "b1", "--stage", "image", "--command-id", command_id]
    result = CliRunner().invoke(cli.main, argv, env={"ANIMASTOR_LOCAL_DIR": "/nonexistent/animastor-local"})
    assert result.exit_code != 0
    assert f"resend with --command-id {command_id}" in result.output, result.output


def test_reconcile_prints_readable_lines_without_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """It printed the report's Python repr (`{'rebuilt_books': 0, ...}`)."""
    from animastor_tasks.flow import reconcile

    report = {"rebuilt_books": 2, "expired": 0, "round_done": True}
    monkeypatch.setattr(reconcile, "reconcile", lambda *_, **__: report)
    monkeypatch.setattr(cli, "_wired", lambda: type("W", (), {"ports": None})())
    result = CliRunner().invoke(cli.main, ["reconcile"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["rebuilt books: 2", "expired: 0", "round done: True"]
    as_json = CliRunner().invoke(cli.main, ["reconcile", "--json"])
    assert '"rebuilt_books": 2' in as_json.output
