"""The command gate: the one place that decides whether a scene x stage may have work.

A pair may be queued or dispatched only while (1) an active command of its stage
targets its scene, (2) its stage's layer is enabled for the book and (3) the book
is not cancelled. Facts are read once per pass (see `flow.gate`) or once per job
start (see `flow.generate`); the decisions themselves are pure, and the job-start
decision is the pass decision plus the fencing check, so the two cannot drift.
An unreadable registry proves no command: nothing is authorized.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Protocol, TypeVar

from animastor_tasks.domain.types import Pair, SceneKey
from animastor_tasks.domain.vocabulary import AUTHORIZING, AssetState


class Denial(StrEnum):
    CANCELLED = "cancelled"  # Stop All: the Redis flag or the Postgres tombstone
    NO_ACTIVE_TASK = "no_active_task"  # no active command of the stage targets the scene
    LAYER_DISABLED = "layer_disabled"  # the book has the stage's layer turned off
    # Only at job start:
    UNKNOWN_PAIR = "unknown_pair"  # the scene or the book is gone
    STALE_TOKEN = "stale_token"  # the pair was re-dispatched, released or settled since this job was sent


def parse_layers(raw: str | None) -> dict[str, bool]:
    """Layer config as `{"<stage>_enabled": bool}`; missing or broken means no override."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, bool)}


def layer_enabled(layers: dict[str, bool], stage: str) -> bool:
    return layers.get(f"{stage}_enabled") is not False


def changed_layers(raw: str | None, changes: Mapping[str, bool]) -> str:
    """The layer config `raw` with `changes` ({stage: enabled}) made and every other stage's setting kept, one this
    process's stage table lacks included: another process's table may have it."""
    layers = parse_layers(raw)
    layers.update({f"{stage}_enabled": enabled for stage, enabled in changes.items()})
    return json.dumps(layers, sort_keys=True)


@dataclass(frozen=True)
class CommandFact:
    """One command of a book as the registry holds it: its status, its stage and the scenes it targets."""

    status: str
    stage: str
    targets: frozenset[SceneKey]


def commanded_pairs(commands: Iterable[CommandFact]) -> frozenset[Pair]:
    """The pairs the commands authorize: only a command whose status authorizes (`AUTHORIZING`: active),
    for its own stage, on the scenes it targets. A blocked, cancelled, completed or failed command
    authorizes nothing. The gate's SQL (`adapters/postgres/assets.py`) filters on the same statuses."""
    return frozenset(
        (chapter, scene, command.stage)
        for command in commands
        if command.status in AUTHORIZING
        for chapter, scene in command.targets
    )


@dataclass(frozen=True)
class BookFacts:
    """Everything one gate pass needs to know about one book, read in one go."""

    registry_readable: bool
    cancel_flag: bool = False
    tombstone: bool = False
    layers_raw: str | None = None
    commanded: frozenset[Pair] = frozenset()  # pairs targeted by an ACTIVE command (`commanded_pairs`)

    @property
    def cancelled(self) -> bool:
        return self.cancel_flag or self.tombstone

    @cached_property
    def layers(self) -> dict[str, bool]:
        """Parsed once per pass, not once per pair."""
        return parse_layers(self.layers_raw)

    @cached_property
    def disabled_stages(self) -> frozenset[str]:
        """The stages whose layer is off (`layer_enabled`), once per pass: a pass over 100k pairs asks 100k times."""
        return frozenset(
            k.removesuffix("_enabled") for k, v in self.layers.items() if k.endswith("_enabled") and v is False
        )


@dataclass(frozen=True)
class SceneAuthorization:
    stages: frozenset[str]
    denied: dict[str, Denial] = field(default_factory=dict)


def decide(facts: BookFacts, pair: Pair) -> Denial | None:
    """None when the pair is authorized, else the first reason it is not."""
    _chapter, _scene, stage = pair
    if facts.cancelled:
        return Denial.CANCELLED
    if not facts.registry_readable or pair not in facts.commanded:
        return Denial.NO_ACTIVE_TASK
    if stage in facts.disabled_stages:
        return Denial.LAYER_DISABLED
    return None


class HasPair(Protocol):
    @property
    def pair(self) -> Pair: ...


Item = TypeVar("Item", bound=HasPair)


def decide_all(facts: BookFacts, items: Sequence[Item]) -> tuple[list[Item], dict[Pair, Denial]]:
    """`decide` over a pass's pairs: the authorized items in their order, and why each other pair is denied.
    The same answers; in the usual case (not cancelled, no layer off) one set lookup per pair."""
    if facts.cancelled or not facts.registry_readable or facts.disabled_stages:
        authorized: list[Item] = []
        denied: dict[Pair, Denial] = {}
        for item in items:
            reason = decide(facts, item.pair)
            if reason is None:
                authorized.append(item)
            else:
                denied[item.pair] = reason
        return authorized, denied
    commanded = facts.commanded
    authorized = [item for item in items if item.pair in commanded]
    if len(authorized) == len(items):
        return authorized, {}
    return authorized, {item.pair: Denial.NO_ACTIVE_TASK for item in items if item.pair not in commanded}


def authorize_scene(facts: BookFacts, chapter: str, scene: str, stages: Iterable[str]) -> SceneAuthorization:
    allowed: set[str] = set()
    denied: dict[str, Denial] = {}
    for stage in stages:
        reason = decide(facts, (chapter, scene, stage))
        if reason is None:
            allowed.add(stage)
        else:
            denied[stage] = reason
    return SceneAuthorization(frozenset(allowed), denied)


@dataclass(frozen=True)
class JobStartFacts:
    """What a GPU job knows at start, read under the pair's row lock (see `ports.Jobs.starting`)."""

    book: BookFacts
    found: bool  # the pair exists
    state: str | None = None
    token: int | None = None  # the pair's current fencing token
    owner: str | None = None  # the dispatch id the pair is generating for


def decide_job_start(facts: JobStartFacts, pair: Pair, token: int, dispatch_id: str) -> Denial | None:
    """None when this job may start GPU work: the gate holds and the job still owns the pair."""
    if facts.book.cancelled:
        return Denial.CANCELLED
    if not facts.found:
        return Denial.UNKNOWN_PAIR
    if facts.state != AssetState.GENERATING or facts.token != token or facts.owner != dispatch_id:
        return Denial.STALE_TOKEN
    return decide(facts.book, pair)
