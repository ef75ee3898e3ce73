"""Which settings a command takes from the local stores `animastor-tasks up` left running (no store needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from animastor_tasks.config import Settings
from animastor_tasks.dev import stores as devstack
from animastor_tasks.operator import cli

LOCAL = {
    "ANIMASTOR_DATABASE_URL": "postgresql://postgres@/animastor?host=/tmp/local-run",
    "ANIMASTOR_REDIS_URL": "unix:///tmp/local-run/redis.sock?db=0",
    "ANIMASTOR_BROKER_URL": "redis+socket:///tmp/local-run/redis.sock",
}


@pytest.fixture
def local_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANIMASTOR_LOCAL_DIR", str(tmp_path))
    monkeypatch.setattr(devstack, "local_env", lambda data_dir=None: dict(LOCAL))
    for key in LOCAL:
        monkeypatch.delenv(key, raising=False)


def test_a_command_that_names_one_store_takes_none_of_the_local_ones(
    local_stores: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Filled in one by one, a command naming only its Redis took the local broker and database: it published where
    no worker of that Redis listened."""
    monkeypatch.setenv("ANIMASTOR_REDIS_URL", "redis://prod-redis:6379/0")
    cli._load_local_env()
    settings = Settings.from_env()
    assert settings.broker_url == "redis://prod-redis:6379/0"
    assert settings.database_url != LOCAL["ANIMASTOR_DATABASE_URL"]
    assert "ANIMASTOR_REDIS_URL set" in capsys.readouterr().err


def test_a_command_that_names_no_store_takes_the_local_ones(local_stores: None) -> None:
    cli._load_local_env()
    settings = Settings.from_env()
    assert (settings.database_url, settings.broker_url) == (
        LOCAL["ANIMASTOR_DATABASE_URL"],
        LOCAL["ANIMASTOR_BROKER_URL"],
    )


def test_a_setting_the_same_as_the_local_one_is_no_conflict(
    local_stores: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANIMASTOR_REDIS_URL", LOCAL["ANIMASTOR_REDIS_URL"])  # the env file sourced
    cli._load_local_env()
    assert Settings.from_env().broker_url == LOCAL["ANIMASTOR_BROKER_URL"]


def test_a_store_the_local_stack_does_not_run_may_be_named_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up` found the configured Postgres and started only Redis: the database named beside it is no conflict."""
    monkeypatch.setenv("ANIMASTOR_LOCAL_DIR", str(tmp_path))
    only_redis = {k: v for k, v in LOCAL.items() if k != "ANIMASTOR_DATABASE_URL"}
    monkeypatch.setattr(devstack, "local_env", lambda data_dir=None: dict(only_redis))
    for key in LOCAL:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ANIMASTOR_DATABASE_URL", "postgresql://postgres@db-host:5432/animastor")
    cli._load_local_env()
    settings = Settings.from_env()
    assert settings.broker_url == LOCAL["ANIMASTOR_BROKER_URL"]
    assert settings.database_url == "postgresql://postgres@db-host:5432/animastor"


def test_down_that_could_not_stop_the_local_stores_exits_non_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It printed the error and exited 0: a script went on as if the stores and their data were gone."""
    from click.testing import CliRunner

    from animastor_tasks.errors import StoreUnavailable

    def refuse(self: devstack.LocalStores) -> list[str]:
        raise StoreUnavailable("postgres", "postgresql:///animastor", "pg_ctl stop failed")

    monkeypatch.setenv("ANIMASTOR_LOCAL_DIR", str(tmp_path))
    monkeypatch.setattr(devstack.LocalStores, "stop", refuse)
    done = CliRunner().invoke(cli.main, ["down"])
    assert done.exit_code == 3, done.output
    assert "pg_ctl stop failed" in done.output


@pytest.mark.parametrize("command", [["down"], ["up"], ["status", "b"]])
def test_a_local_dir_that_is_a_file_is_a_setting_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    """`down` was a NotADirectoryError traceback, exit 1."""
    from click.testing import CliRunner

    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("ANIMASTOR_LOCAL_DIR", str(afile))
    done = CliRunner().invoke(cli.main, command)
    assert done.exit_code == 2, done.output
    assert f"error: ANIMASTOR_LOCAL_DIR: {str(afile)!r} is not a directory" in done.output
