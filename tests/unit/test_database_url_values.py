"""ANIMASTOR_DATABASE_URL's option values and its password, checked before any connection: a value libpq refuses is
a setting to fix (exit 2), not Postgres down (exit 3), and no message repeats the password."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.errors import ConfigError
from animastor_tasks.operator.cli import main


@pytest.mark.parametrize(
    ("query", "libpq_says"),
    [
        ("sslmode=bogus", 'invalid sslmode value: "bogus"'),
        ("target_session_attrs=nope", 'invalid target_session_attrs value: "nope"'),
        ("port=abc", 'invalid integer value "abc"'),
    ],
)
def test_an_option_value_libpq_refuses_is_a_setting_to_fix(query: str, libpq_says: str) -> None:
    """Only option names were checked: a bad value passed, and every connection failed on it, reported as
    "postgres unavailable" after the pool's whole timeout."""
    with pytest.raises(ConfigError, match="ANIMASTOR_DATABASE_URL") as info:
        Database(f"postgresql://u:hunter2@db.example/a?{query}")
    assert libpq_says in str(info.value) and "hunter2" not in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:hunter2@db.example:5432/a?sslmode=verify-full&target_session_attrs=read-write",
        "postgresql://u:hunter2@db.example/a?gssencmode=require&connect_timeout=5",  # no GSS over a socket: not ours
        "postgresql://u@h1:5432,h2:5433/a?target_session_attrs=primary&load_balance_hosts=random",
        "postgresql:///a?host=/var/run/postgresql&port=5433",
        "host=db.example port=5432 dbname=a user=u password=hunter2 sslmode=require",
    ],
)
def test_values_libpq_takes_are_taken(url: str) -> None:
    Database(url).close()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:s3cr%zzet@db.example/a",  # psycopg: invalid percent-encoded token: "s3cr%zzet"
        "postgresql://u:s3cr%zzet@db.example/a?sslmode=bogus",
        "postgresql://u@db.example/a?password=s3cr%zzet",
    ],
)
def test_no_message_repeats_the_password(url: str) -> None:
    with pytest.raises(ConfigError, match="ANIMASTOR_DATABASE_URL") as info:
        Database(url)
    assert "s3cr" not in str(info.value), str(info.value)


def test_the_cli_exits_2_on_an_option_value_libpq_refuses(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ANIMASTOR_LOCAL_DIR", str(tmp_path / "none"))
    env = {
        "ANIMASTOR_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none?sslmode=bogus",
        "ANIMASTOR_REDIS_URL": "redis://127.0.0.1:1/0",
        "ANIMASTOR_BROKER_URL": "redis://127.0.0.1:1/0",
    }
    result = CliRunner().invoke(main, ["db", "migrate", "--lock-wait", "1"], env=env)
    assert result.exit_code == 2 and "ANIMASTOR_DATABASE_URL" in result.output, result.output
