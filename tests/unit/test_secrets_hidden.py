"""A password or token given in a setting never appears in an error or in `describe()`, however it is spelt."""

from __future__ import annotations

import json
import time

import pytest

from animastor_tasks.config import Settings
from animastor_tasks.errors import ConfigError, StoreUnavailable, redact_url

SECRET = "kP9qZ"


def refusal(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env)
    return str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:Xy3/{SECRET}+9@redis:6379/0",  # a base64 password holds '/'
        f"redis://:p@{SECRET}@127.0.0.1:6379/0",  # and '@'
        f"redis://u:p@ss{SECRET}@127.0.0.1:6379/0",
        f"postgresql://u:{SECRET}@db/animastor?sslmode=require",
        f"redis://127.0.0.1:6379/0?password={SECRET}",
        f"rediss://127.0.0.1:6379/0?ssl_password={SECRET}&db=1",
        f"postgresql://db/animastor?sslpassword={SECRET}",
        f"https://gpu/v1?api_key={SECRET}",
        f"https://gpu/v1?X-Amz-Signature={SECRET}&X-Amz-Security-Token={SECRET}",
    ],
)
def test_redact_url_hides_every_spelling_of_a_password(url: str) -> None:
    shown = redact_url(f"failed at {url} (refused)")
    assert SECRET not in shown
    assert shown.startswith("failed at ") and shown.endswith(" (refused)")


def test_redact_url_keeps_what_is_no_secret() -> None:
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://:p@ss@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("postgresql://u:pw@db/a?sslmode=require&password=x") == (
        "postgresql://u:***@db/a?sslmode=require&password=***"
    )
    assert redact_url("rediss://h:6379/0?ssl_keyfile=/k.pem&ssl_cert_reqs=none") == (
        "rediss://h:6379/0?ssl_keyfile=/k.pem&ssl_cert_reqs=none"
    )
    assert redact_url("redis://h:6379/0 and user@example") == "redis://h:6379/0 and user@example"
    assert redact_url("host=db password='a b' port=5432") == "host=db password=*** port=5432"
    assert redact_url("lane key=P:lane:audio token") == "lane key=P:lane:audio token"


@pytest.mark.parametrize(
    "env",
    [
        {"ANIMASTOR_REDIS_URL": f"redis://:Xy3/{SECRET}@redis:6379/0"},
        {"ANIMASTOR_REDIS_URL": f"redis://:Xy3#{SECRET}@redis:6379/0"},
        {"ANIMASTOR_REDIS_URL": f"redis://:Xy3?{SECRET}@redis:6379/0"},
        {"ANIMASTOR_DATABASE_URL": f"postgresql://u:{SECRET}#x@db/animastor"},
        {"ANIMASTOR_REDIS_URL": f"redis://:p@{SECRET}@127.0.0.1:6379/x"},
        {"ANIMASTOR_REDIS_URL": f"redis://127.0.0.1:6379/0?password={SECRET}&bogus=1"},
        {"ANIMASTOR_BROKER_URL": f"amqp://u:{SECRET}@rabbit//?ssl_password={SECRET}&bogus=1"},
        {"ANIMASTOR_DATABASE_URL": f"mysql://db/animastor?password={SECRET}"},
        {"ANIMASTOR_DATABASE_URL": f"host=db password={SECRET} dbname=animastor"},  # libpq's keyword form
        {"ANIMASTOR_DATABASE_URL": f"host=db password = '{SECRET} x' dbname=animastor"},
        {"ANIMASTOR_DATABASE_URL": f"host=db sslpassword='a\\' {SECRET}' dbname=animastor"},
        {"ANIMASTOR_ARTIFACT_URL": f"file://u:{SECRET}@host/dir"},
        {"ANIMASTOR_ARTIFACT_URL": f"file:///dir?token={SECRET}"},
        {"ANIMASTOR_STAGES": json.dumps({"image": {"endpoint": f"http://u:{SECRET}@gpu/x", "limt": 1}})},
        {"ANIMASTOR_STAGES": json.dumps({"image": {"endpoint": f"http://gpu/x?api_key={SECRET}", "limt": 1}})},
        {"ANIMASTOR_STAGES": json.dumps({"image": {"endpoint": f"http://u:{SECRET}@gpu:0/x"}})},
        {"ANIMASTOR_STAGES": '{"image": {"endpoint": "http:\\/\\/u:' + SECRET + '@gpu\\/x", "limt": 1}}'},
        {"ANIMASTOR_STAGES": '{"image": {"endpoint": "http://u:' + SECRET + '@gpu/x"}'},  # not JSON
    ],
)
def test_a_refused_setting_never_shows_its_secret(env: dict[str, str]) -> None:
    assert SECRET not in refusal(env)


def test_a_password_the_url_parser_cannot_read_is_explained_not_quoted() -> None:
    said = refusal({"ANIMASTOR_REDIS_URL": f"redis://:Xy3#{SECRET}@redis:6379/0"})
    assert "Xy3" not in said
    assert "percent-encoded" in said and "%23" in said


def test_describe_hides_query_passwords() -> None:
    settings = Settings.from_env({"ANIMASTOR_REDIS_URL": f"redis://127.0.0.1:6379/0?password={SECRET}"})
    assert SECRET not in json.dumps(settings.describe())


def test_a_store_error_hides_a_password_with_a_slash() -> None:
    error = StoreUnavailable("redis", f"redis://:Xy3/{SECRET}@redis:6379/0", "connection refused")
    assert SECRET not in str(error) and SECRET not in repr(error.args)


@pytest.mark.parametrize("text", ["a" * 65536, "http://a" * 8000, "http:///" * 8000, "?password" * 6000])
def test_redacting_a_long_word_takes_no_time(text: str) -> None:
    """A server's error body (up to 64 KB) goes through it: a backtracking pattern took 24 s on 64 KB of letters."""
    started = time.monotonic()
    redact_url(text)
    assert time.monotonic() - started < 1.0


def test_a_port_out_of_range_is_named_with_a_login_in_the_url() -> None:
    """It read "its login cannot be read" for `postgres@host:99999`, sending the operator after a password."""
    said = refusal({"ANIMASTOR_DATABASE_URL": "postgresql://postgres@127.0.0.1:99999/x"})
    assert "port is out of range 0-65535" in said and "login cannot be read" not in said
    said = refusal({"ANIMASTOR_REDIS_URL": f"redis://:Xy3#{SECRET}@redis:6379/0"})  # still a password, not a port
    assert "login cannot be read" in said
