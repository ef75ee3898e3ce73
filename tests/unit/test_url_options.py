"""The option lists the settings check URLs against (animastor_tasks/url_options.py, kept by hand because the
settings may import no driver) agree with the installed redis-py and kombu: every option they let through, with
a value they let through, is one the driver reads without an error."""

from __future__ import annotations

import pytest

from animastor_tasks.errors import ConfigError
from animastor_tasks.url_options import KOMBU_AMQP, KOMBU_SOCKET, KOMBU_TLS, redis_py_options

SAMPLES = {  # one value of each option that the checks accept
    "db": "2",
    "socket_timeout": "2.5",
    "socket_connect_timeout": "1",
    "socket_read_size": "65536",
    "health_check_interval": "10",
    "max_connections": "20",
    "retry_on_timeout": "true",
    "retry_on_error": "ConnectionError,TimeoutError",
    "legacy_responses": "true",
    "protocol": "3",
    "client_name": "animastor",
    "lib_name": "animastor",
    "lib_version": "1",
    "username": "u",
    "password": "p",
    "encoding": "latin-1",
    "encoding_errors": "replace",
    "socket_keepalive": "false",
    "ssl_cert_reqs": "optional",
    "ssl_check_hostname": "false",
    "ssl_validate_ocsp": "false",
    "ssl_validate_ocsp_stapled": "false",
    "ssl_keyfile": "/k.pem",
    "ssl_certfile": "/c.pem",
    "ssl_ca_certs": "/ca.pem",
    "ssl_ca_path": "/ca",
    "ssl_ca_data": "x",
    "ssl_password": "p",
    "ssl_ciphers": "HIGH",
    "virtual_host": "3",
    "heartbeat": "30",
    "login_method": "PLAIN",
    "ssl": "true",
    "insist": "false",
}
BASES = {"redis": "redis://127.0.0.1:1/0", "rediss": "rediss://127.0.0.1:1/0", "unix": "unix:///run/r.sock"}


@pytest.mark.parametrize("scheme", sorted(BASES))
def test_every_option_let_through_is_one_redis_py_reads(scheme: str) -> None:
    import redis

    for option in redis_py_options(scheme):
        url = f"{BASES[scheme]}{'&' if '?' in BASES[scheme] else '?'}{option}={SAMPLES[option]}"
        pool = redis.ConnectionPool.from_url(url)
        pool.connection_class(**pool.connection_kwargs)  # connects nowhere; raises on what it cannot take


@pytest.mark.parametrize(
    ("base", "rules"),
    [
        ("rediss://127.0.0.1:1/0", KOMBU_TLS),
        ("redis+socket:///run/r.sock", KOMBU_SOCKET),
        ("amqp://u:p@h:1//", KOMBU_AMQP),
    ],
)
def test_every_option_let_through_is_one_kombu_reads(base: str, rules: dict[str, object]) -> None:
    import kombu

    for option in rules:
        if option != "connect_timeout":
            kombu.Connection(f"{base}?{option}={SAMPLES[option]}")


AMQP, REDIS = "amqp://guest:guest@127.0.0.1:5672//", "redis://h:1/0"


@pytest.mark.parametrize(
    ("name", "url", "refusal"),
    [  # no socket or pool can work with these
        ("ANIMASTOR_REDIS_URL", f"{REDIS}?socket_timeout=0", "socket_timeout must be a finite number above 0"),
        (
            "ANIMASTOR_REDIS_URL",
            f"{REDIS}?socket_connect_timeout=0.0",
            "socket_connect_timeout must be a finite number above 0",
        ),
        ("ANIMASTOR_REDIS_URL", f"{REDIS}?socket_read_size=0", "socket_read_size must be a whole number above 0"),
        ("ANIMASTOR_REDIS_URL", f"{REDIS}?client_name=a%20b", "client_name must be printable ASCII without blanks"),
        # kombu would misread these
        (
            "ANIMASTOR_BROKER_URL",
            f"{AMQP}?connect_timeout=5",
            "connect_timeout must be left out: kombu passes it on as text",
        ),
        ("ANIMASTOR_BROKER_URL", f"{AMQP}?ssl=false", "ssl must be true \\(kombu reads any value as true"),
        ("ANIMASTOR_BROKER_URL", f"{AMQP}?ssl=0", "ssl must be true"),
    ],
)
def test_an_option_its_client_cannot_use_as_meant_is_refused(name: str, url: str, refusal: str) -> None:
    from animastor_tasks.config import Settings

    with pytest.raises(ConfigError, match=refusal):
        Settings.from_env({name: url})


def test_the_amqp_ssl_let_through_is_read_as_true_and_the_heartbeat_as_a_number() -> None:
    import kombu

    conn = kombu.Connection(f"amqp://u:p@h:1//?ssl={SAMPLES['ssl']}&heartbeat=30")
    assert conn.ssl and conn.heartbeat == 30.0


@pytest.mark.parametrize(
    "query", ["max_connections=0", "lib_name=my%20app&lib_version=1.0%20beta", "insist=false", "insist=no"]
)
def test_options_that_worked_before_the_refusals_still_pass(query: str) -> None:
    """0 connections is redis-py's default pool (100); CLIENT SETINFO's refusal of a blank is ignored by redis-py;
    py-amqp ignores `insist`. A review found the first version of the refusals refused them."""
    from animastor_tasks.config import Settings

    url = f"redis://127.0.0.1:6379/0?{query}" if "insist" not in query else ""
    env = (
        {"ANIMASTOR_REDIS_URL": url}
        if url
        else {"ANIMASTOR_BROKER_URL": f"amqp://guest:guest@127.0.0.1:5672//?{query}"}
    )
    settings = Settings.from_env(env)
    assert query in (settings.redis_url if url else settings.broker_url)


@pytest.mark.parametrize("option", ["retry_on_error=TimeoutError", "legacy_responses=true"])
def test_an_option_the_runtime_read_before_the_check_is_still_taken(option: str) -> None:
    """The check refused options redis-py reads from a URL (and the result store too), which had worked: a
    deployment upgraded with one in its ANIMASTOR_REDIS_URL would not have started."""
    from animastor_tasks.config import Settings

    settings = Settings.from_env({"ANIMASTOR_REDIS_URL": f"redis://127.0.0.1:6379/0?{option}"})
    assert option in settings.redis_url
