"""A `rediss://` URL says how the server's certificate is checked (`ssl_cert_reqs`), or the process stops at start.

*Why:* without it Celery's result store raised a bare ValueError at each worker's banner and each `Client` call
(exit 1, a restart loop), and kombu opened the broker with no certificate check at all (it only logs a warning).
"""

from __future__ import annotations

import pytest
from celery import Celery

from animastor_tasks.config import Settings, result_backend_url
from animastor_tasks.errors import ConfigError


@pytest.mark.parametrize(
    ("name", "url"),
    [
        ("ANIMASTOR_REDIS_URL", "rediss://:hunter2@redis.example:6380/0"),
        ("ANIMASTOR_REDIS_URL", "rediss://:hunter2@redis.example:6380/0?ssl_ca_certs=/etc/ssl/ca.pem"),
        ("ANIMASTOR_REDIS_URL", "rediss://:hunter2@redis.example:6380/0?ssl_cert_reqs="),
        ("ANIMASTOR_BROKER_URL", "rediss://:hunter2@redis.example:6380/0"),
        ("ANIMASTOR_BROKER_URL", "rediss://:hunter2@redis.example:6380/0?ssl_ca_certs=/etc/ssl/ca.pem"),
    ],
)
def test_a_rediss_url_without_ssl_cert_reqs_is_refused_naming_the_variable(name: str, url: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name}=.*ssl_cert_reqs=required") as info:
        Settings.from_env({name: url})
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("reqs", ["required", "optional", "none"])
def test_a_rediss_url_with_ssl_cert_reqs_builds_the_result_store_and_a_checking_broker(reqs: str) -> None:
    import ssl

    from kombu import Connection

    url = f"rediss://:pw@redis.example:6380/0?ssl_cert_reqs={reqs}&ssl_ca_certs=/etc/ssl/ca.pem"
    settings = Settings.from_env({"ANIMASTOR_REDIS_URL": url})
    app = Celery("probe", broker="memory://", backend=result_backend_url(settings.redis_url))
    wanted = getattr(ssl, f"CERT_{reqs.upper()}")
    assert app.backend.connparams["ssl_cert_reqs"] == wanted  # connects nowhere
    broker_tls = Connection(settings.broker_url).ssl
    assert isinstance(broker_tls, dict) and broker_tls["ssl_cert_reqs"] == wanted


def test_the_cli_refuses_a_rediss_url_without_ssl_cert_reqs_with_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from animastor_tasks.operator.cli import main

    monkeypatch.setenv("ANIMASTOR_LOCAL_DIR", "/nonexistent/animastor-local")
    env = {"ANIMASTOR_REDIS_URL": "rediss://127.0.0.1:1/0?ssl_ca_certs=/etc/ssl/ca.pem"}
    result = CliRunner().invoke(main, ["cancel", "b1", "--timeout", "1"], env=env)
    assert result.exit_code == 2, (result.output, result.exception)
    assert "ANIMASTOR_REDIS_URL" in result.output and "ssl_cert_reqs=required" in result.output
