"""The media registry: which stages exist, their queues and their limits.

A stage is configuration, not code: adding `video -> gpu.video` is one more entry
in the table given to `registry_from_table` (env `ANIMASTOR_STAGES`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_QUEUE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
INPUT_FIELDS = ("text", "prompt")
STAGE_KEYS = frozenset(
    {"queue", "input", "media_type", "lease_ttl", "lane_limit", "book_quota", "window", "book_cap", "generator"}
    | {"endpoint", "params"}
)
_KNOWN = ", ".join(sorted(STAGE_KEYS))
# The installed generators that call an inference server: each needs the stage's `endpoint`.
SERVER_GENERATORS = frozenset({"http", "openai-speech", "openai-images"})

DEFAULT_TABLE: dict[str, dict[str, Any]] = {
    "audio": {"queue": "gpu.audio", "input": "text", "media_type": "audio/wav"},
    "image": {"queue": "gpu.image", "input": "prompt", "media_type": "image/png"},
}


# The control plane's queue: regenerate, cancel, gate, tick and reconcile run there.
CONTROL_QUEUE = "animastor.control"
CONTROL_TASKS = ("regenerate", "cancel", "gate", "gate_batch", "tick", "reconcile")
#: The header the client stamps a regenerate and a Stop All with: when it was sent (unix seconds, the broker's clock).
SENT_AT_HEADER = "animastor_sent_at"
#: Where the client's regenerates wait in the control queue of a Redis broker, by their priority (kombu serves a
#: queue's priority lists lowest first; a Stop All, a gate pass and the runtime's own messages go at 0). *Why:* in one
#: queue, first in first out, a reader's interactive scene sent during a burst of 300 regenerates waited 2.6 s for the
#: control workers to take the burst, and 22 bulk jobs started before it.
CONTROL_ORDER = {"interactive": 0, "normal": 3, "bulk": 6}


@dataclass(frozen=True)
class StageSpec:
    """One stage: its queue, its guards and where its input comes from."""

    name: str
    queue: str
    input_field: str = "text"
    media_type: str = "application/octet-stream"
    lease_ttl: int = 120
    lane_limit: int = 8
    book_quota: int = 4
    window: int = 4
    book_cap: int | None = None  # hard cap on one book's generating pairs (quota and window are fair shares)
    generator: str = "builtin"
    endpoint: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def task_name(self) -> str:
        return f"animastor.generate.{self.name}"

    @property
    def fingerprint(self) -> str:
        """Generator and parameters: part of the input hash, so a book imported after either changed has its ready
        media of the stage marked stale (a regenerate without force makes it again); until then, nothing changes."""
        return json.dumps([self.generator, dict(self.params)], sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class MediaRegistry:
    stages: tuple[StageSpec, ...]

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def queues(self) -> tuple[str, ...]:
        return tuple(s.queue for s in self.stages)

    def get(self, name: str) -> StageSpec:
        for spec in self.stages:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(s.name == name for s in self.stages)


# The most a number setting may be (31 years of seconds), here and in `config`. *Why:* past it, a lease's expiry or a
# limit's count overflowed Redis's or Postgres's integers where used: a `lease_ttl` of 1e17 had every job of the stage
# requeued for ever, `ANIMASTOR_FORCE_TTL_SECONDS=1e20` failed every regenerate, both as 'redis unavailable'.
MOST = 1_000_000_000


def _positive_int(stage: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MOST:
        raise ValueError(f"stage {stage!r}: {key} must be a whole number from 1 to {MOST:,}, got {value!r}")
    return value


def _text(stage: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"stage {stage!r}: {key} must be a non-empty string, got {value!r}")
    return value


_TOKEN = r"[A-Za-z0-9!#$%&'*+.^_`|~-]+"  # RFC 9110's, as are the parameters and quoted strings below
_QUOTED = r'"(?:[\t !#-\[\]-~]|\\[\t -~])*"'
_MEDIA_TYPE = re.compile(rf"{_TOKEN}/{_TOKEN}(?:[ \t]*;[ \t]*(?:{_TOKEN}=(?:{_TOKEN}|{_QUOTED}))?)*")


def _media_type(stage: str, value: Any) -> str:
    """`type/subtype`, with parameters if any (RFC 9110). *Why:* it is sent as an HTTP header and
    stored as the artifact's Content-Type: one with a line break let the worker start, and every job failed."""
    if not isinstance(value, str) or not _MEDIA_TYPE.fullmatch(value):
        raise ValueError(f"stage {stage!r}: media_type must be a media type such as 'audio/wav', got {value!r}")
    return value


def _endpoint(stage: str, value: Any) -> str | None:
    """An http(s) URL with a host, a port in 1-65535 and no blank or control character. *Why:* `http://`,
    `http://host:99999/x` or `http://ho st/x` passed start-up; the GPU worker started healthy and every job of
    the stage failed `misconfigured`."""
    if value is None:
        return None
    ok = isinstance(value, str) and value.startswith(("http://", "https://")) and value.isprintable()
    if ok and not any(ch.isspace() for ch in value):
        try:
            parts = urlsplit(value)
            ok = bool(parts.hostname) and parts.port != 0  # `.port` raises ValueError past 65535
        except ValueError:
            ok = False
    else:
        ok = False
    if not ok:
        raise ValueError(
            f"stage {stage!r}: endpoint must be an http(s) URL with a host (a port, if any, 1-65535; no blanks),"
            f" got {value!r}"
        )
    return str(value)


def registry_from_table(table: Mapping[str, Any] | None) -> MediaRegistry:
    """Build the registry from `{stage: {queue, input, media_type, lease_ttl, ...}}`."""
    table = DEFAULT_TABLE if table is None else table
    if not isinstance(table, Mapping) or not table:
        raise ValueError("the stage table must be a non-empty JSON object")
    stages: list[StageSpec] = []
    seen_queues: set[str] = set()
    for name, entry in table.items():
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name == "all":
            raise ValueError(f"stage name {name!r} must be lower-case letters, digits or '_' (and not 'all')")
        if not isinstance(entry, Mapping):
            raise ValueError(f"stage {name!r}: entry must be an object, got {entry!r}")
        queue = entry.get("queue", f"gpu.{name}")
        if not isinstance(queue, str) or not _QUEUE_RE.fullmatch(queue) or queue == "animastor.control":
            raise ValueError(f"stage {name!r}: queue {queue!r} is not a valid queue name")
        if queue in seen_queues:
            raise ValueError(f"stage {name!r}: queue {queue!r} is used by another stage")
        seen_queues.add(queue)
        input_field = entry.get("input", "text")
        if input_field not in INPUT_FIELDS:
            raise ValueError(f"stage {name!r}: input must be one of {INPUT_FIELDS}, got {input_field!r}")
        endpoint = _endpoint(name, entry.get("endpoint"))
        unknown = sorted(set(entry) - STAGE_KEYS)
        if unknown:  # a misspelt limit was ignored: the stage ran with the default it meant to change
            raise ValueError(f"stage {name!r}: unknown key(s) {', '.join(map(repr, unknown))} (known: {_KNOWN})")
        params = entry.get("params", {})
        if not isinstance(params, Mapping):
            raise ValueError(f"stage {name!r}: params must be an object, got {params!r}")
        generator = _text(name, "generator", entry.get("generator", "http" if endpoint else "builtin"))
        if generator == "builtin" and endpoint is not None:  # its placeholders were stored as ready, the server unused
            raise ValueError(
                f"stage {name!r}: generator 'builtin' makes placeholder media and calls no endpoint; drop"
                " 'generator' (an endpoint means 'http') or the endpoint"
            )
        if generator in SERVER_GENERATORS and endpoint is None:  # every job failed `misconfigured`
            raise ValueError(f"stage {name!r}: generator {generator!r} calls an inference server: give its 'endpoint'")
        stages.append(
            StageSpec(
                name=name,
                queue=queue,
                input_field=input_field,
                media_type=_media_type(name, entry.get("media_type", "application/octet-stream")),
                lease_ttl=_positive_int(name, "lease_ttl", entry.get("lease_ttl", 120)),
                lane_limit=_positive_int(name, "lane_limit", entry.get("lane_limit", 8)),
                book_quota=_positive_int(name, "book_quota", entry.get("book_quota", 4)),
                window=_positive_int(name, "window", entry.get("window", 4)),
                book_cap=None if entry.get("book_cap") is None else _positive_int(name, "book_cap", entry["book_cap"]),
                generator=generator,
                endpoint=endpoint,
                params=dict(params),
            )
        )
    return MediaRegistry(tuple(stages))


#: What every process's stage table must agree on: each claim counts against the limits of its own process's table.
LIMITS = ("queue", "lane_limit", "book_quota", "window", "book_cap")


def limits_of(registry: MediaRegistry) -> dict[str, dict[str, Any]]:
    return {s.name: {key: getattr(s, key) for key in LIMITS} for s in registry.stages}


def limits_differ(mine: Mapping[str, Mapping[str, Any]], theirs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each limit two tables disagree on, as `stage key: mine/theirs` (a stage only one of them has: `-`)."""
    differ = []
    for stage in sorted(set(mine) | set(theirs)):
        here, there = mine.get(stage), theirs.get(stage)
        if here is None or there is None:
            differ.append(f"{stage}: {'-' if here is None else 'set'}/{'-' if there is None else 'set'}")
            continue
        differ.extend(
            f"{stage} {key}: {here.get(key)}/{there.get(key)}" for key in LIMITS if here.get(key) != there.get(key)
        )
    return differ
