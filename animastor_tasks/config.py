"""Settings: one frozen object built from the environment and validated when built.

Every process (worker, beat, CLI, tests) calls `Settings.from_env()`; a bad value
fails at start-up with a `ConfigError` naming the variable and showing the value,
never later in the middle of a dispatch.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit

from animastor_tasks.domain.deferral import DeferralWindows
from animastor_tasks.domain.registry import MOST, MediaRegistry, StageSpec, registry_from_table
from animastor_tasks.errors import ConfigError, redact_url
from animastor_tasks.url_options import check_broker_options, check_redis_options, check_redis_path, why_unreadable

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/animastor"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
MAX_RETENTION_DAYS = 36_500
DAY = 86_400.0  # seconds

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's bucket naming rules
_KEY_PREFIX_RE = re.compile(r"[A-Za-z0-9!_.*'()/-]{0,512}")  # S3's safe key characters


@dataclass(frozen=True)
class Settings:
    database_url: str = DEFAULT_DATABASE_URL
    redis_url: str = DEFAULT_REDIS_URL
    broker_url: str = DEFAULT_REDIS_URL
    key_prefix: str = "animastor"
    registry: MediaRegistry = field(default_factory=lambda: registry_from_table(None))
    tick_seconds: float = 5.0
    reconcile_seconds: float = 30.0
    reconcile_pairs: int = 100_000  # pairs in flight one reconcile passes at most (one book at least)
    presence_ttl_seconds: float = 6.0
    silent_worker_seconds: float = 30.0  # a GPU worker's heartbeat silent this long: the tick gives its jobs away
    force_ttl_seconds: int = 120
    capacity_defer_seconds: int = 60
    idempotent_defer_seconds: int = 900
    breaker_threshold: int = 5
    breaker_cooldown_seconds: float = 30.0
    artifact_root: Path = Path("artifacts")  # the local store's directory
    artifact_url: str = ""  # s3://bucket/prefix: the store GPU hosts share; empty: the directory above
    journal_retention_days: float = 7.0
    journal_max_rows: int = 1_000_000
    command_retention_days: float = 0.0  # ended commands kept this long; 0: for ever
    job_soft_time_limit: int = 1800
    job_time_limit: int = 1900
    visibility_timeout: int = 3600
    generate_max_retries: int = 3
    retry_backoff_base: float = 1.0
    retry_backoff_max: float = 30.0
    worker_lost_limit: int = 3
    job_chain_seconds: float = 30.0  # a ready job's process runs its slot's next job itself this long into its task
    inference_api_key: str = ""
    db_pool_max: int = 8

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        return self.registry.stages

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        redis_url = _url(env, "ANIMASTOR_REDIS_URL", DEFAULT_REDIS_URL, ("redis", "rediss", "unix"))
        presence_ttl = _number(env, "ANIMASTOR_PRESENCE_TTL_SECONDS", 6.0, minimum=1.0)
        settings = cls(
            database_url=_url(env, "ANIMASTOR_DATABASE_URL", DEFAULT_DATABASE_URL, ("postgresql", "postgres")),
            redis_url=redis_url,
            broker_url=_broker_url(env, redis_url),
            key_prefix=_prefix(env),
            registry=_registry(env),
            # At most a day: beat's schedule is a timedelta, and a period past its range failed every process.
            tick_seconds=_number(env, "ANIMASTOR_TICK_SECONDS", 5.0, minimum=0.1, maximum=DAY),
            reconcile_seconds=_number(env, "ANIMASTOR_RECONCILE_SECONDS", 30.0, minimum=0.5, maximum=DAY),
            reconcile_pairs=_integer(env, "ANIMASTOR_RECONCILE_PAIRS", 100_000, minimum=1, maximum=2**53),
            presence_ttl_seconds=presence_ttl,
            # Unset, at least two presence TTLs: a longer TTL set before this setting existed stays valid.
            silent_worker_seconds=_number(
                env, "ANIMASTOR_SILENT_WORKER_SECONDS", max(30.0, 2 * presence_ttl), minimum=2.0
            ),
            force_ttl_seconds=_integer(env, "ANIMASTOR_FORCE_TTL_SECONDS", 120, minimum=1),
            capacity_defer_seconds=_integer(env, "ANIMASTOR_CAPACITY_DEFER_SECONDS", 60, minimum=1),
            idempotent_defer_seconds=_integer(env, "ANIMASTOR_IDEMPOTENT_DEFER_SECONDS", 900, minimum=1),
            breaker_threshold=_integer(env, "ANIMASTOR_BREAKER_THRESHOLD", 5, minimum=1),
            breaker_cooldown_seconds=_number(env, "ANIMASTOR_BREAKER_COOLDOWN_SECONDS", 30.0, minimum=0.1),
            **_artifact_store(env),
            journal_retention_days=_retention_days(env, "ANIMASTOR_JOURNAL_RETENTION_DAYS", 7.0),
            journal_max_rows=_integer(env, "ANIMASTOR_JOURNAL_MAX_ROWS", 1_000_000, minimum=100, maximum=2**53),
            command_retention_days=_retention_days(env, "ANIMASTOR_COMMAND_RETENTION_DAYS", 0.0),
            job_soft_time_limit=_integer(env, "ANIMASTOR_JOB_SOFT_TIME_LIMIT", 1800, minimum=1),
            job_time_limit=_integer(env, "ANIMASTOR_JOB_TIME_LIMIT", 1900, minimum=1),
            visibility_timeout=_integer(env, "ANIMASTOR_VISIBILITY_TIMEOUT", 3600, minimum=1),
            generate_max_retries=_integer(env, "ANIMASTOR_GENERATE_MAX_RETRIES", 3, minimum=0),
            retry_backoff_base=_number(env, "ANIMASTOR_RETRY_BACKOFF_BASE", 1.0, minimum=0.0),
            retry_backoff_max=_number(env, "ANIMASTOR_RETRY_BACKOFF_MAX", 30.0, minimum=0.0),
            worker_lost_limit=_integer(env, "ANIMASTOR_WORKER_LOST_LIMIT", 3, minimum=1),
            job_chain_seconds=_number(env, "ANIMASTOR_JOB_CHAIN_SECONDS", 30.0, minimum=0.0),
            inference_api_key=_api_key(env),
            db_pool_max=_integer(env, "ANIMASTOR_DB_POOL_MAX", 8, minimum=1),
        )
        settings.check_time_limits()
        settings.check_silence()
        return settings

    def check_time_limits(self) -> None:
        """A job must be stopped softly, then hard, before the broker redelivers it."""
        if not self.job_soft_time_limit < self.job_time_limit < self.visibility_timeout:
            raise ConfigError(
                "time limits must satisfy ANIMASTOR_JOB_SOFT_TIME_LIMIT < ANIMASTOR_JOB_TIME_LIMIT < "
                f"ANIMASTOR_VISIBILITY_TIMEOUT, got {self.job_soft_time_limit} < {self.job_time_limit} < "
                f"{self.visibility_timeout}"
            )

    def check_silence(self) -> None:
        """A worker's heartbeat may come late by most of a TTL: silence must outlast two before it means a death."""
        if self.silent_worker_seconds < 2 * self.presence_ttl_seconds:
            raise ConfigError(
                "ANIMASTOR_SILENT_WORKER_SECONDS must be at least twice ANIMASTOR_PRESENCE_TTL_SECONDS, got"
                f" {self.silent_worker_seconds:g} and {self.presence_ttl_seconds:g}"
            )

    @property
    def chain_budget_seconds(self) -> float:
        """How far into its task a GPU process may still start its freed slot's next job itself
        (`worker/chain.py`): that job shares the task's time limits, so at most a tenth of the soft one."""
        return min(self.job_chain_seconds, self.job_soft_time_limit / 10)

    @property
    def deferral_windows(self) -> DeferralWindows:
        return DeferralWindows(self.capacity_defer_seconds, self.idempotent_defer_seconds)

    @property
    def broker_is_amqp(self) -> bool:
        return urlsplit(self.broker_url).scheme in ("amqp", "amqps", "pyamqp")

    def describe(self) -> dict[str, Any]:
        """What an operator may see: URLs with passwords hidden."""
        return {
            "database_url": redact_url(self.database_url),
            "redis_url": redact_url(self.redis_url),
            "broker_url": redact_url(self.broker_url),
            "key_prefix": self.key_prefix,
            "stages": {s.name: s.queue for s in self.stages},
            "artifact_store": self.artifact_url or self.artifact_root.expanduser().resolve().as_uri(),
        }


def _url(env: Mapping[str, str], name: str, default: str, schemes: tuple[str, ...]) -> str:
    value = env.get(name, "").strip() or default
    if not value.isprintable():  # not shown: it may hold a password. *Why:* a UnicodeEncodeError traceback, exit 1
        raise ConfigError(f"{name} holds a byte that is not UTF-8 or a control character: percent-encode it (%E9)")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as err:
        raise ConfigError(f"{name}={redact_url(value)!r} is not a valid URL: {why_unreadable(value, err)}") from err
    if parts.scheme not in schemes:
        raise ConfigError(f"{name}={redact_url(value)!r} must use one of the schemes {', '.join(schemes)}")
    if parts.scheme not in ("unix", "redis+socket") and not parts.hostname and "host=" not in parts.query:
        raise ConfigError(f"{name}={redact_url(value)!r} names no host")
    if parts.scheme in ("redis", "rediss"):
        check_redis_path(name, value)
    if name == "ANIMASTOR_REDIS_URL":
        check_redis_options(name, value)
    return value


def _number(env: Mapping[str, str], name: str, default: float, *, minimum: float, maximum: float = MOST) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return float(default)
    try:
        if "_" in raw:  # Python's digit grouping: `5_0` was read as 50
            raise ValueError(raw)
        value = float(raw)
    except ValueError as err:
        raise ConfigError(f"{name}={raw!r} is not a number") from err
    if not math.isfinite(value):  # `inf` and `nan` parse as floats
        raise ConfigError(f"{name}={raw!r} must be a finite number")
    if not value >= minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum}")
    if value > maximum:
        raise ConfigError(f"{name}={raw!r} must be at most {maximum:g}")
    return value


def _retention_days(env: Mapping[str, str], name: str, default: float) -> float:
    """Days of history kept. Capped at a century: a larger "keep for ever" passed start-up and then failed every
    reconcile on Postgres's date range, where the cut-off is computed."""
    return _number(env, name, default, minimum=0.0, maximum=MAX_RETENTION_DAYS)


def _integer(env: Mapping[str, str], name: str, default: int, *, minimum: int, maximum: float = MOST) -> int:
    """A whole number: `2.5` is refused rather than silently truncated."""
    value = _number(env, name, default, minimum=minimum, maximum=maximum)
    if not value.is_integer():
        raise ConfigError(f"{name}={env.get(name)!r} must be a whole number")
    return int(value)


def _api_key(env: Mapping[str, str]) -> str:
    """The key, without the newline a secret made from a file carries: sent as it was, the HTTP client refused
    the header and quoted it in an error that the key's scrubbing (which looks for the key as given) missed."""
    value = env.get("ANIMASTOR_INFERENCE_API_KEY", "").strip()
    if any(not ch.isprintable() for ch in value):
        raise ConfigError("ANIMASTOR_INFERENCE_API_KEY holds a control character (the key is not shown)")
    if not value.isascii():  # a `…` pasted in: every job's header failed to encode, a bug failing the whole lane
        raise ConfigError(
            "ANIMASTOR_INFERENCE_API_KEY holds a character outside ASCII (a typographic quote or an ellipsis pasted"
            " in?): HTTP headers carry nothing else reliably; the key is not shown"
        )
    return value


def _prefix(env: Mapping[str, str]) -> str:
    value = env.get("ANIMASTOR_KEY_PREFIX", "animastor")
    if not _PREFIX_RE.fullmatch(value):
        raise ConfigError(f"ANIMASTOR_KEY_PREFIX={value!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
    return value


def _artifact_store(env: Mapping[str, str]) -> dict[str, Any]:
    """ANIMASTOR_ARTIFACT_URL: a directory, `file:///dir` or `s3://bucket/prefix`; unset, the directory
    ANIMASTOR_ARTIFACT_ROOT (default `artifacts`). Checked here so that a typo stops the process at start."""
    root = _directory("ANIMASTOR_ARTIFACT_ROOT", env.get("ANIMASTOR_ARTIFACT_ROOT", "").strip() or "artifacts")
    raw = env.get("ANIMASTOR_ARTIFACT_URL", "").strip()
    if not raw:
        return {"artifact_root": root}
    name = "ANIMASTOR_ARTIFACT_URL"
    if "://" not in raw:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", raw):  # `s3:bucket`: a URL typo, not a directory name
            raise ConfigError(
                f"{name}={redact_url(raw)!r} must be a directory, file:///directory or s3://bucket/prefix"
            )
        return {"artifact_root": _directory(name, raw)}
    try:
        parts = urlsplit(raw)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as err:
        raise ConfigError(f"{name}={redact_url(raw)!r} is not a valid URL: {why_unreadable(raw, err)}") from err
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/") or parts.query or parts.fragment:
            raise ConfigError(f"{name}={redact_url(raw)!r} must be file:///absolute/directory")
        return {"artifact_root": _directory(name, unquote(parts.path))}
    if parts.scheme == "s3":
        split_s3_url(raw)  # raises ConfigError naming what is wrong
        _endpoint(env)
        return {"artifact_root": root, "artifact_url": raw.rstrip("/")}
    raise ConfigError(f"{name}={redact_url(raw)!r} must be a directory, file:///directory or s3://bucket/prefix")


def _directory(name: str, path: str) -> Path:
    """*Why:* `~nosuchuser/x` was a RuntimeError traceback from every command, and a NUL (`file:///a%00b`) passed
    the start-up checks and failed every job, the pair left generating."""
    try:
        if "\x00" not in path:
            return Path(path).expanduser()
    except RuntimeError as err:  # a user that does not exist
        raise ConfigError(f"{name}={path!r}: {err}") from None
    raise ConfigError(f"{name}={path!r}: a directory's name cannot hold a NUL character")


def split_s3_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes at its ends) of `s3://bucket/prefix`; ConfigError when malformed."""
    name = "ANIMASTOR_ARTIFACT_URL"
    parts = urlsplit(url)
    if parts.scheme != "s3" or parts.query or parts.fragment or "@" in parts.netloc or ":" in parts.netloc:
        raise ConfigError(f"{name}={redact_url(url)!r} must be s3://bucket/prefix (no credentials, port or query)")
    if not _BUCKET_RE.fullmatch(parts.netloc) or ".." in parts.netloc:
        raise ConfigError(f"{name}={url!r}: {parts.netloc!r} is not a bucket name (3-63 of a-z, 0-9, '.', '-')")
    prefix = parts.path.strip("/")
    if not _KEY_PREFIX_RE.fullmatch(prefix) or "//" in prefix:
        raise ConfigError(f"{name}={url!r}: the key prefix {prefix!r} must be S3-safe characters without '//'")
    if any(segment in (".", "..") for segment in prefix.split("/")):
        # A server on a filesystem (rclone's, MinIO's) resolves such a segment: keys outside the prefix, or refused.
        raise ConfigError(f"{name}={url!r}: the key prefix {prefix!r} must have no '.' or '..' segment")
    return parts.netloc, prefix


def _endpoint(env: Mapping[str, str]) -> None:
    """The S3 endpoint boto3 will take from the environment (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL;
    neither: AWS itself), checked now rather than at the first upload."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if env.get(name, "").strip():
            _url(env, name, "", ("http", "https"))
            return


def _registry(env: Mapping[str, str]) -> MediaRegistry:
    raw = env.get("ANIMASTOR_STAGES", "").strip()
    if not raw:
        return registry_from_table(None)
    try:
        table = json.loads(raw, object_pairs_hook=_once_each, parse_constant=_finite, parse_float=_finite)
    except ValueError as err:  # not JSON at all, a key given twice, a number no request body can carry
        what = " is not valid JSON: " if isinstance(err, json.JSONDecodeError) else ": "
        raise ConfigError(_shown_table(f"ANIMASTOR_STAGES={raw!r}{what}{err}")) from err
    try:
        if table is None:  # `null` is not the absent table: it was read as the default one, unsaid
            raise ValueError("the stage table must be a non-empty JSON object, got null")
        return registry_from_table(table)
    except ValueError as err:
        raise ConfigError(_shown_table(f"ANIMASTOR_STAGES={raw!r}: {err}")) from err


def _shown_table(message: str) -> str:
    """A refusal of the stage table with the logins and tokens of its endpoints hidden, JSON's `\\/` read as `/`
    (`http:\\/\\/u:pw@gpu` is a URL too)."""
    return redact_url(message.replace("\\\\/", "/").replace("\\/", "/"))


def _finite(text: str) -> float:
    """A finite number. *Why:* Python reads NaN, Infinity, 1e400: the worker started, every job's request refused."""
    if not math.isfinite(value := float(text)):
        raise ValueError(f"{text} is no number a request body can carry (JSON has no NaN or Infinity)")
    return value


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once. *Why:* JSON keeps the last copy of a repeated key silently: a
    stage written twice lost the `input` of its first copy, and its images were made from the scene text."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"{key!r} twice in one object; give each key once")
        seen.add(key)
    return dict(pairs)


def _broker_url(env: Mapping[str, str], redis_url: str) -> str:
    """ANIMASTOR_BROKER_URL; by default the coordination Redis, spelled as kombu reads a socket and without the
    redis-py options kombu's Connection takes none of (they are the runtime's own client's). *Why:* with
    `?socket_timeout=5`, every process that sent a task died in kombu with a TypeError traceback. The login
    redis-py reads in the query (`?password=`) goes into the authority, where kombu reads it: it was dropped, and
    the broker connected without the password. Its `?db=` goes into the path, kombu's only place for it: the
    queues were in db 0, shared with whatever else is there."""
    if not env.get("ANIMASTOR_BROKER_URL", "").strip():
        base, _, query = result_backend_url(redis_url).partition("?")
        if db := dict(parse_qsl(query)).get("db"):  # a `unix://` URL's is its `virtual_host` already
            base = urlsplit(base)._replace(path=f"/{db}").geturl()
        kept = urlencode([(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if _kombu_reads(k)], safe="/")
        base = _with_login(base, redis_url)
        return f"{base}?{kept}" if kept else base
    url = _url(env, "ANIMASTOR_BROKER_URL", redis_url, ("redis", "rediss", "redis+socket", "amqp", "amqps", "pyamqp"))
    check_broker_options("ANIMASTOR_BROKER_URL", url)
    return url


def _kombu_reads(option: str) -> bool:
    """A query option kombu's Connection takes from a Redis URL."""
    return option.startswith("ssl_") or option == "virtual_host"


def result_backend_url(redis_url: str) -> str:
    """Celery's spelling of a Redis URL: a redis-py `unix://` socket becomes `redis+socket://`, with its login."""
    parts = urlsplit(redis_url)
    if parts.scheme != "unix":
        return redis_url
    db = parse_qs(parts.query).get("db", ["0"])[0]
    return f"{_with_login(f'redis+socket://{parts.path}', redis_url)}?virtual_host={db}"


def _with_login(base: str, redis_url: str) -> str:
    """`base` (a URL without query) with the login redis-py reads from `redis_url`: its authority's, else its query's
    `username` and `password` (the authority wins, as in redis-py), percent-encoded into the authority."""
    parts = urlsplit(redis_url)
    query = dict(parse_qsl(parts.query))
    user = unquote(parts.username or "") or query.get("username", "")
    password = unquote(parts.password or "") or query.get("password", "")
    if not user and not password:
        return base
    login = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    target = urlsplit(base)
    return f"{target.scheme}://{login}@{target.netloc.rpartition('@')[2]}{target.path}"


def redis_py_url(url: str) -> str:
    """redis-py's spelling of a kombu Redis URL (the inverse of `result_backend_url`): a `redis+socket://` socket
    becomes `unix://`, its `virtual_host` the database kombu keeps the queues in."""
    parts = urlsplit(url)
    if parts.scheme != "redis+socket":
        return url
    db = parse_qs(parts.query).get("virtual_host", ["0"])[0].strip("/")
    return f"unix://{parts.netloc}{parts.path}?db={db if db.isdigit() else 0}"
