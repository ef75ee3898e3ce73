from __future__ import annotations

import json

import pytest

from animastor_tasks.config import Settings
from animastor_tasks.domain.deferral import (
    DeferralWindows,
    compute_backoff,
    deferral_bucket,
    deferral_seconds,
    retry_delay,
)
from animastor_tasks.domain.registry import registry_from_table
from animastor_tasks.domain.vocabulary import Outcome
from animastor_tasks.errors import ConfigError
from animastor_tasks.worker.celery_config import build_config


def test_default_registry() -> None:
    reg = registry_from_table(None)
    assert reg.names() == ("audio", "image")
    assert reg.get("audio").queue == "gpu.audio" and reg.get("image").queue == "gpu.image"
    assert reg.get("image").task_name == "animastor.generate.image"


def test_a_third_stage_is_configuration_only() -> None:
    table = {
        "audio": {"queue": "gpu.audio"},
        "image": {"queue": "gpu.image", "input": "prompt"},
        "video": {"queue": "gpu.video", "input": "prompt", "lease_ttl": 600, "lane_limit": 2, "book_quota": 1},
    }
    settings = Settings.from_env({"ANIMASTOR_STAGES": json.dumps(table)})
    assert settings.registry.names() == ("audio", "image", "video")
    video = settings.registry.get("video")
    assert (video.lease_ttl, video.lane_limit, video.book_quota) == (600, 2, 1)
    conf = build_config(settings)
    assert {q.name for q in conf["task_queues"]} == {"animastor.control", "gpu.audio", "gpu.image", "gpu.video"}
    assert conf["task_routes"]["animastor.generate.video"] == {"queue": "gpu.video"}


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"ANIMASTOR_DATABASE_URL": "mysql://x"}, "ANIMASTOR_DATABASE_URL"),
        ({"ANIMASTOR_REDIS_URL": "redis://host:notaport/0"}, "notaport"),
        # redis-py took a database that is no number as database 0 (another application's, say).
        ({"ANIMASTOR_REDIS_URL": "redis://127.0.0.1:6379/animastor"}, "database number"),
        ({"ANIMASTOR_REDIS_URL": "redis://127.0.0.1:6379/0/extra"}, "database number"),
        ({"ANIMASTOR_BROKER_URL": "redis://127.0.0.1:6379/-1"}, "ANIMASTOR_BROKER_URL"),
        ({"ANIMASTOR_TICK_SECONDS": "soon"}, "'soon'"),
        ({"ANIMASTOR_TICK_SECONDS": "-1"}, "ANIMASTOR_TICK_SECONDS"),
        ({"ANIMASTOR_RECONCILE_PAIRS": "many"}, "ANIMASTOR_RECONCILE_PAIRS"),
        ({"ANIMASTOR_RECONCILE_PAIRS": "0"}, "ANIMASTOR_RECONCILE_PAIRS"),
        ({"ANIMASTOR_STAGES": "{oops"}, "ANIMASTOR_STAGES"),
        # Read as the default table, unsaid (a hunt); `5_0` read as 50.
        ({"ANIMASTOR_STAGES": "null"}, "must be a non-empty JSON object, got null"),
        ({"ANIMASTOR_TICK_SECONDS": "5_0"}, "ANIMASTOR_TICK_SECONDS='5_0' is not a number"),
        ({"ANIMASTOR_STAGES": '{"audio": {"lease_ttl": 0}}'}, "lease_ttl"),
        ({"ANIMASTOR_STAGES": '{"a": {"queue": "q"}, "b": {"queue": "q"}}'}, "used by another stage"),
        ({"ANIMASTOR_KEY_PREFIX": "bad prefix*"}, "ANIMASTOR_KEY_PREFIX"),
        # A trailing newline passed `$`: a stage named "audio\n", a queue "gpu.x\n" on the broker, keys under it.
        ({"ANIMASTOR_KEY_PREFIX": "animastor\n"}, "ANIMASTOR_KEY_PREFIX"),
        ({"ANIMASTOR_STAGES": '{"audio\\n": {}}'}, "stage name"),
        ({"ANIMASTOR_STAGES": '{"audio": {"queue": "gpu.audio\\n"}}'}, "not a valid queue name"),
        ({"ANIMASTOR_JOB_TIME_LIMIT": "10", "ANIMASTOR_JOB_SOFT_TIME_LIMIT": "20"}, "SOFT_TIME_LIMIT"),
        ({"ANIMASTOR_VISIBILITY_TIMEOUT": "100"}, "VISIBILITY_TIMEOUT"),
        ({"ANIMASTOR_SILENT_WORKER_SECONDS": "10"}, "twice ANIMASTOR_PRESENCE_TTL_SECONDS"),  # the TTL is 6
        ({"ANIMASTOR_PRESENCE_TTL_SECONDS": "20", "ANIMASTOR_SILENT_WORKER_SECONDS": "30"}, "got 30 and 20"),
        # A whole number given as `inf` was an OverflowError traceback; `2.5` was silently truncated.
        ({"ANIMASTOR_FORCE_TTL_SECONDS": "inf"}, "ANIMASTOR_FORCE_TTL_SECONDS"),
        ({"ANIMASTOR_TICK_SECONDS": "inf"}, "ANIMASTOR_TICK_SECONDS"),
        # Finite but past a timedelta's range: every process failed with an OverflowError traceback.
        ({"ANIMASTOR_TICK_SECONDS": "1e14"}, "at most 86400"),
        ({"ANIMASTOR_RECONCILE_SECONDS": "1e14"}, "at most 86400"),
        ({"ANIMASTOR_BREAKER_THRESHOLD": "2.5"}, "ANIMASTOR_BREAKER_THRESHOLD"),
        ({"ANIMASTOR_INFERENCE_API_KEY": "sk-a\x00b"}, "ANIMASTOR_INFERENCE_API_KEY"),
        # "Keep for ever" as a huge number passed start-up, then every reconcile failed on Postgres's interval range.
        ({"ANIMASTOR_JOURNAL_RETENTION_DAYS": "999999999"}, "ANIMASTOR_JOURNAL_RETENTION_DAYS"),
        ({"ANIMASTOR_COMMAND_RETENTION_DAYS": "1e9"}, "ANIMASTOR_COMMAND_RETENTION_DAYS"),
        # A null generator or media type became the string 'None'; a misspelt key was ignored (8 slots kept).
        ({"ANIMASTOR_STAGES": '{"image": {"endpoint": "http://x", "generator": null}}'}, "generator"),
        ({"ANIMASTOR_STAGES": '{"audio": {"media_type": null}}'}, "media_type"),
        ({"ANIMASTOR_STAGES": '{"audio": {"media_type": 3}}'}, "media_type"),
        ({"ANIMASTOR_STAGES": '{"audio": {"lane_limt": 2}}'}, "lane_limt"),
        # A key given twice kept its last copy silently: the stage's `input` lost, its images made from the text.
        ({"ANIMASTOR_STAGES": '{"image": {"input": "prompt"}, "image": {"queue": "gpu.img2"}}'}, "'image' twice"),
        ({"ANIMASTOR_STAGES": '{"audio": {"lane_limit": 2, "lane_limit": 20}}'}, "'lane_limit' twice"),
        # Python's JSON reads NaN, Infinity and a number past a float's range: the worker started, and every job
        # failed on a body no request can carry (retried as a backend fault, though nothing was ever sent).
        ({"ANIMASTOR_STAGES": '{"audio": {"params": {"speed": NaN}}}'}, "NaN"),
        ({"ANIMASTOR_STAGES": '{"audio": {"params": {"speed": -Infinity}}}'}, "-Infinity"),
        ({"ANIMASTOR_STAGES": '{"audio": {"params": {"cfg": [1, Infinity]}}}'}, "Infinity"),
        ({"ANIMASTOR_STAGES": '{"audio": {"params": {"speed": 1e400}}}'}, "1e400"),
        # Past what Redis's expiries and Postgres's integers hold: started, then failed where used ("redis down").
        ({"ANIMASTOR_FORCE_TTL_SECONDS": "1e20"}, "ANIMASTOR_FORCE_TTL_SECONDS='1e20' must be at most 1e+09"),
        ({"ANIMASTOR_PRESENCE_TTL_SECONDS": "1e11"}, "ANIMASTOR_PRESENCE_TTL_SECONDS"),
        ({"ANIMASTOR_STAGES": '{"audio": {"lease_ttl": 100000000000000000}}'}, "lease_ttl must be a whole number"),
        ({"ANIMASTOR_STAGES": '{"audio": {"lane_limit": 1e23}}'}, "lane_limit must be a whole number"),
        ({"ANIMASTOR_STAGES": '{"audio": {"lane_limit": 100000000000000000000000}}'}, "from 1 to 1,000,000,000"),
        # A media type is an HTTP header and a Content-Type: a line break started the worker, and every job failed.
        ({"ANIMASTOR_STAGES": '{"audio": {"media_type": "audio/wav\\r\\nX-Evil: 1"}}'}, "media_type must be a media"),
        ({"ANIMASTOR_STAGES": '{"audio": {"media_type": "audio/w\u00e9v"}}'}, "media_type must be a media"),
        ({"ANIMASTOR_STAGES": '{"audio": {"media_type": "audio"}}'}, "media_type must be a media"),
        # A traceback (exit 1) from every command; a NUL passed start-up and failed every job, its pair left generating.
        ({"ANIMASTOR_ARTIFACT_ROOT": "~no-such-user-here/x"}, "ANIMASTOR_ARTIFACT_ROOT='~no-such-user-here/x'"),
        ({"ANIMASTOR_ARTIFACT_URL": "~no-such-user-here/x"}, "ANIMASTOR_ARTIFACT_URL='~no-such-user-here/x'"),
        ({"ANIMASTOR_ARTIFACT_URL": "file:///tmp/a%00b"}, "cannot hold a NUL character"),
        # A byte that is not UTF-8 (read as a lone surrogate): a UnicodeEncodeError traceback, the password unshown.
        ({"ANIMASTOR_DATABASE_URL": "postgresql://u:S3cret\udce9@h/db"}, "ANIMASTOR_DATABASE_URL holds a byte"),
        ({"ANIMASTOR_REDIS_URL": "redis://:S3cret\udce9@h/0"}, "ANIMASTOR_REDIS_URL holds a byte that is not UTF-8"),
        # The endpoint was ignored: placeholder images stored as ready, the inference server never called.
        ({"ANIMASTOR_STAGES": '{"image": {"generator": "builtin", "endpoint": "http://gpu-box:8765/v1"}}'}, "builtin"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env)
    assert needle in str(info.value) and "S3cret" not in str(info.value)


def test_password_never_shown() -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"ANIMASTOR_DATABASE_URL": "mysql://user:s3cret@host/db"})
    assert "s3cret" not in str(info.value)
    described = Settings.from_env({"ANIMASTOR_REDIS_URL": "redis://:hunter2@127.0.0.1:6379/0"}).describe()
    assert "hunter2" not in json.dumps(described)


def test_a_job_run_in_its_predecessors_task_starts_within_a_tenth_of_the_soft_time_limit() -> None:
    assert Settings.from_env({}).chain_budget_seconds == 30.0
    assert Settings.from_env({"ANIMASTOR_JOB_CHAIN_SECONDS": "0"}).chain_budget_seconds == 0.0
    short = {"ANIMASTOR_JOB_SOFT_TIME_LIMIT": "60", "ANIMASTOR_JOB_TIME_LIMIT": "90"}
    assert Settings.from_env(short).chain_budget_seconds == 6.0
    with pytest.raises(ConfigError, match="ANIMASTOR_JOB_CHAIN_SECONDS"):
        Settings.from_env({"ANIMASTOR_JOB_CHAIN_SECONDS": "-1"})


def test_reconcile_passes_a_budget_of_pairs_in_flight() -> None:
    assert Settings.from_env({}).reconcile_pairs == 100_000
    assert Settings.from_env({"ANIMASTOR_RECONCILE_PAIRS": "5000"}).reconcile_pairs == 5000


def test_settings_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Settings().key_prefix = "x"  # type: ignore[misc]


def test_taxonomy_windows() -> None:
    w = DeferralWindows(60, 900)
    assert {deferral_seconds(o, w) for o in (Outcome.LANE_FULL, Outcome.QUOTA_EXHAUSTED, Outcome.WINDOW_FULL)} == {60}
    assert {deferral_seconds(o, w) for o in (Outcome.ALREADY_COMPLETED, Outcome.ALREADY_GENERATING)} == {900}
    # A fence rejection is a stale dispatch's, not its pair's: nothing is deferred for it.
    assert deferral_bucket(Outcome.FENCE_REJECTED) is None and deferral_seconds(Outcome.FENCE_REJECTED, w) is None
    assert deferral_bucket(Outcome.BLOCKED) is None and deferral_seconds(Outcome.PUBLISH_FAILED, w) is None


def test_backoff_is_capped_and_pure() -> None:
    assert [compute_backoff(n, base=1, maximum=5) for n in range(0, 6)] == [0, 1, 2, 4, 5, 5]
    # A backend's Retry-After waits longer than the backoff, never past its cap, and never shortens it.
    assert [retry_delay(n, base=1, maximum=5, asked=3) for n in range(1, 5)] == [3, 3, 4, 5]
    assert retry_delay(1, base=1, maximum=5, asked=60) == 5
    assert retry_delay(3, base=1, maximum=5, asked=None) == retry_delay(3, base=1, maximum=5, asked=0) == 4


def test_result_backend_speaks_celerys_socket_form() -> None:
    from animastor_tasks.config import result_backend_url

    assert result_backend_url("unix:///tmp/r/redis.sock?db=3") == "redis+socket:///tmp/r/redis.sock?virtual_host=3"
    assert result_backend_url("redis://127.0.0.1:6379/2") == "redis://127.0.0.1:6379/2"


def test_each_pool_child_sees_one_gpu() -> None:
    from animastor_tasks.worker.app import gpu_for_child

    assert [gpu_for_child("0,1", i) for i in range(4)] == ["0", "1", "0", "1"]
    assert gpu_for_child(" 3 , 5", 1) == "5"
    assert gpu_for_child("", 0) is None


def test_a_missing_tool_fails_under_ci_and_skips_elsewhere(monkeypatch) -> None:
    import pytest

    from tests.support import missing

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must provide it"):
        missing("RabbitMQ is not listening")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="fails under CI=true"):
        missing("RabbitMQ is not listening")


def test_ended_commands_are_kept_for_ever_unless_a_retention_is_set() -> None:
    assert Settings.from_env({}).command_retention_days == 0.0
    assert Settings.from_env({"ANIMASTOR_COMMAND_RETENTION_DAYS": "30"}).command_retention_days == 30.0
    with pytest.raises(ConfigError, match="ANIMASTOR_COMMAND_RETENTION_DAYS"):
        Settings.from_env({"ANIMASTOR_COMMAND_RETENTION_DAYS": "-1"})


def test_an_api_key_loses_the_newline_a_secret_file_gave_it() -> None:
    """A key ending in a newline made the HTTP client refuse the header and quote it (escaped) in an error
    that the key's scrubbing missed: the key reached the pair's stored error and the logs."""
    assert Settings.from_env({"ANIMASTOR_INFERENCE_API_KEY": "sk-abc\r\n"}).inference_api_key == "sk-abc"
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"ANIMASTOR_INFERENCE_API_KEY": "sk-a\nbc"})
    assert "sk-a" not in str(info.value)


@pytest.mark.parametrize("key", ["sk-abc\u2026def", "sk-\u201cabc\u201d", "sk-abcé"])
def test_an_api_key_outside_ascii_is_refused_at_start_without_being_shown(key: str) -> None:
    """A key pasted with a `…` or a typographic quote could not be sent (HTTP headers are Latin-1): every job raised
    a bare UnicodeEncodeError, a generator bug, and every pair of the lane failed at full speed, the breaker told
    nothing. Outside ASCII (Latin-1 too: no server's key holds an `é`), the worker refuses to start."""
    with pytest.raises(ConfigError, match="ANIMASTOR_INFERENCE_API_KEY") as info:
        Settings.from_env({"ANIMASTOR_INFERENCE_API_KEY": key})
    assert "abc" not in str(info.value)


def test_a_unix_socket_redis_url_is_the_brokers_too_in_celerys_spelling() -> None:
    """Without ANIMASTOR_BROKER_URL the broker is the coordination Redis: a `unix://` URL, which kombu does not
    read, was refused as a broker scheme, so a Redis on a socket needed its URL written twice, two ways."""
    from animastor_tasks.config import Settings

    settings = Settings.from_env({"ANIMASTOR_REDIS_URL": "unix:///run/redis/redis.sock?db=2"})
    assert settings.redis_url == "unix:///run/redis/redis.sock?db=2"
    assert settings.broker_url == "redis+socket:///run/redis/redis.sock?virtual_host=2"
    tcp = Settings.from_env({"ANIMASTOR_REDIS_URL": "redis://10.0.0.5:6379/1"})
    assert tcp.broker_url == "redis://10.0.0.5:6379/1"


def test_a_kombu_socket_url_is_spelled_for_redis_py_with_its_database() -> None:
    from animastor_tasks.config import redis_py_url, result_backend_url

    assert redis_py_url("redis+socket:///tmp/r/redis.sock?virtual_host=3") == "unix:///tmp/r/redis.sock?db=3"
    assert redis_py_url("redis+socket:///tmp/r/redis.sock") == "unix:///tmp/r/redis.sock?db=0"
    assert redis_py_url(result_backend_url("unix:///tmp/r.sock?db=2")) == "unix:///tmp/r.sock?db=2"
    assert redis_py_url("redis://127.0.0.1:6379/2") == "redis://127.0.0.1:6379/2"


def test_silence_defaults_to_thirty_seconds_or_two_presence_ttls_if_longer() -> None:
    assert Settings.from_env({}).silent_worker_seconds == 30.0
    assert Settings.from_env({"ANIMASTOR_PRESENCE_TTL_SECONDS": "60"}).silent_worker_seconds == 120.0
    assert Settings.from_env({"ANIMASTOR_SILENT_WORKER_SECONDS": "12.5"}).silent_worker_seconds == 12.5


def test_a_redis_url_option_redis_cannot_read_stops_the_process_at_start() -> None:
    """`?socket_timeout=abc` passed start-up as a ValueError deep in the wiring, a traceback."""
    from animastor_tasks.adapters.redis.connection import RedisConnection
    from animastor_tasks.domain.keys import Keyspace

    with pytest.raises(ConfigError, match=r"ANIMASTOR_REDIS_URL.*socket_timeout") as info:
        RedisConnection("redis://:hunter2@127.0.0.1:6379/0?socket_timeout=abc", Keyspace("t"))
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2@127.0.0.1:6379/0?sockettimeout=5",
        "unix:///run/redis.sock?db=0&retry_on_timout=1",
        "rediss://:hunter2@r.example:6380/0?ssl_cert_reqs=required&healthcheck_interval=10",
    ],
)
def test_a_redis_url_option_redis_py_does_not_know_stops_the_process_at_start(url: str) -> None:
    """redis-py handed a misspelt option to each connection, which refused it with a TypeError: a traceback from
    every command, and the metrics exporter took a Redis that was fine for down."""
    from animastor_tasks.adapters.redis.connection import RedisConnection
    from animastor_tasks.domain.keys import Keyspace

    with pytest.raises(ConfigError, match=r"ANIMASTOR_REDIS_URL.*(sockettimeout|retry_on_timout|healthcheck)") as info:
        RedisConnection(url, Keyspace("t"))
    assert "hunter2" not in str(info.value)


def test_a_database_url_option_libpq_does_not_know_is_a_setting_to_fix_not_postgres_down() -> None:
    """It was read at the first connection: the pool's whole timeout, then exit 3 "postgres unavailable"."""
    from animastor_tasks.adapters.postgres.pool import Database

    with pytest.raises(ConfigError, match=r"ANIMASTOR_DATABASE_URL.*connect_timout") as info:
        Database("postgresql://u:hunter2@db.example:5432/a?connect_timout=5")
    assert "hunter2" not in str(info.value)
    Database("postgresql://u:hunter2@db.example:5432/a?connect_timeout=5&application_name=x").close()


@pytest.mark.parametrize(
    ("redis_url", "broker_url"),
    [
        ("redis://127.0.0.1:6379/0?socket_timeout=5&health_check_interval=10", "redis://127.0.0.1:6379/0"),
        (
            "rediss://r.example:6380/1?ssl_cert_reqs=required&socket_keepalive=true",
            "rediss://r.example:6380/1?ssl_cert_reqs=required",
        ),
        ("unix:///run/redis.sock?db=2&socket_timeout=5", "redis+socket:///run/redis.sock?virtual_host=2"),
    ],
)
def test_redis_py_options_of_the_redis_url_stay_out_of_the_broker_derived_from_it(
    redis_url: str, broker_url: str
) -> None:
    """`ANIMASTOR_REDIS_URL=redis://...?socket_timeout=5` passed the check, then every process that sent a task
    died in kombu with a TypeError traceback: the broker is that URL too, and kombu's Connection takes no
    redis-py option. Its options are the runtime's own client's; the broker keeps only the TLS ones."""
    import kombu

    settings = Settings.from_env({"ANIMASTOR_REDIS_URL": redis_url})
    assert settings.redis_url == redis_url and settings.broker_url == broker_url
    assert kombu.Connection(settings.broker_url).transport_cls  # kombu reads it (nothing connects)


def test_a_broker_url_with_an_option_kombu_cannot_read_stops_the_process_at_start() -> None:
    with pytest.raises(ConfigError, match=r"ANIMASTOR_BROKER_URL.*socket_timeout"):
        Settings.from_env({"ANIMASTOR_BROKER_URL": "redis://:pw@127.0.0.1:6379/0?socket_timeout=5"})


@pytest.mark.parametrize(
    ("name", "url"),
    [
        ("ANIMASTOR_REDIS_URL", "redis://:hunter2@127.0.0.1:6379/0?socket_timeout=abc"),
        ("ANIMASTOR_REDIS_URL", "redis://:hunter2@127.0.0.1:6379/0?foo=1"),
        ("ANIMASTOR_REDIS_URL", "unix:///run/redis.sock?db=abc"),
        ("ANIMASTOR_REDIS_URL", "rediss://:hunter2@r.example:6380/0?ssl_cert_reqs=bogus"),
        ("ANIMASTOR_BROKER_URL", "amqp://u:hunter2@mq.example//?heartbeat=abc"),
        ("ANIMASTOR_BROKER_URL", "amqp://u:hunter2@mq.example//?foo=1"),
        ("ANIMASTOR_BROKER_URL", "rediss://:hunter2@r.example:6380/0?ssl_cert_reqs=bogus"),
    ],
)
def test_a_url_option_its_client_cannot_read_is_a_config_error_naming_the_variable(name: str, url: str) -> None:
    """Options were read only when a client was made: a ValueError, TypeError or KeyError traceback (exit 1) from
    `cancel`, `status` or a GPU worker's start, rather than the ConfigError (exit 2) every other bad value gives."""
    with pytest.raises(ConfigError, match=name) as info:
        Settings.from_env({name: url})
    assert "hunter2" not in str(info.value)


def test_the_cli_refuses_a_bad_url_option_with_exit_2_before_it_sends_anything(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from animastor_tasks.operator.cli import main

    monkeypatch.setenv("ANIMASTOR_LOCAL_DIR", "/nonexistent/animastor-local")
    for env in (
        {"ANIMASTOR_REDIS_URL": "redis://127.0.0.1:1/0?socket_timeout=abc"},
        {"ANIMASTOR_REDIS_URL": "rediss://127.0.0.1:1/0?ssl_cert_reqs=bogus"},
        {"ANIMASTOR_BROKER_URL": "amqp://127.0.0.1:1//?heartbeat=abc"},
    ):
        result = CliRunner().invoke(main, ["cancel", "b1", "--timeout", "1"], env=env)
        assert result.exit_code == 2, (env, result.output, result.exception)
        assert next(iter(env)) in result.output


def test_a_redis_broker_url_with_its_database_twice_is_refused() -> None:
    """kombu takes `virtual_host` from a socket URL only: beside a host URL's path it was a TypeError traceback."""
    with pytest.raises(ConfigError, match=r"ANIMASTOR_BROKER_URL.*virtual_host"):
        Settings.from_env({"ANIMASTOR_BROKER_URL": "redis://127.0.0.1:6379/0?virtual_host=2"})


def test_a_count_setting_may_pass_a_billion() -> None:
    """Rows and pairs are counted in bigints: the cap for seconds refused a journal of 5e9 rows (a review)."""
    env = {"ANIMASTOR_JOURNAL_MAX_ROWS": "5000000000", "ANIMASTOR_RECONCILE_PAIRS": "10000000000"}
    settings = Settings.from_env(env)
    assert (settings.journal_max_rows, settings.reconcile_pairs) == (5_000_000_000, 10_000_000_000)
