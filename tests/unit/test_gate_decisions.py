"""The decision table: command x layer x cancel x registry -> authorization and reason."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest

from animastor_tasks.domain.gate import (
    BookFacts,
    CommandFact,
    Denial,
    JobStartFacts,
    authorize_scene,
    commanded_pairs,
    decide,
    decide_all,
    decide_job_start,
    parse_layers,
)
from animastor_tasks.domain.vocabulary import CommandStatus

PAIR = ("ch1", "s1", "audio")
COMMANDS = [
    "none",
    "active_this_stage",
    "active_other_stage",
    "active_other_scene",
    "blocked",
    "cancelled",
    "completed",
    "failed",
    "finished_and_active_other_stage",
]
LAYERS = {"on": '{"audio_enabled": true}', "off": '{"audio_enabled": false}', "missing": None, "broken": "{not json"}
CANCELS = {"none": (False, False), "flag": (True, False), "tombstone": (False, True), "both": (True, True)}


def command_rows(command: str) -> list[CommandFact]:
    """The book's commands as the registry holds them, statuses and all: nothing is filtered here."""
    here, elsewhere = frozenset({("ch1", "s1")}), frozenset({("ch1", "s2"), ("ch2", "s1")})
    return {
        "none": [],
        "active_this_stage": [CommandFact(CommandStatus.ACTIVE, "audio", here | elsewhere)],
        "active_other_stage": [CommandFact(CommandStatus.ACTIVE, "image", here)],
        "active_other_scene": [CommandFact(CommandStatus.ACTIVE, "audio", elsewhere)],
        "blocked": [CommandFact(CommandStatus.BLOCKED, "audio", here)],
        "cancelled": [CommandFact(CommandStatus.CANCELLED, "audio", here)],
        "completed": [CommandFact(CommandStatus.COMPLETED, "audio", here)],
        "failed": [CommandFact(CommandStatus.FAILED, "audio", here)],
        "finished_and_active_other_stage": [
            CommandFact(CommandStatus.COMPLETED, "audio", here),
            CommandFact(CommandStatus.CANCELLED, "audio", here),
            CommandFact(CommandStatus.ACTIVE, "image", here),
        ],
    }[command]


def commanded_for(command: str) -> frozenset[tuple[str, str, str]]:
    """Only an ACTIVE command of this stage that targets the scene authorizes it: the domain's rule
    (`commanded_pairs`, the statuses the gate SQL filters on too) applied to the raw rows."""
    return commanded_pairs(command_rows(command))


@pytest.mark.parametrize("status", list(CommandStatus))
def test_only_an_active_command_authorizes_its_targets(status: CommandStatus) -> None:
    rows = [CommandFact(status, "audio", frozenset({("ch1", "s1"), ("ch1", "s2")}))]
    expected_pairs = {("ch1", "s1", "audio"), ("ch1", "s2", "audio")} if status == CommandStatus.ACTIVE else set()
    assert commanded_pairs(rows) == expected_pairs


def expected(command: str, layer: str, cancel: str, readable: bool) -> Denial | None:
    if cancel != "none":
        return Denial.CANCELLED
    if not readable or command != "active_this_stage":
        return Denial.NO_ACTIVE_TASK
    if layer == "off":
        return Denial.LAYER_DISABLED
    return None


@pytest.mark.parametrize(
    ("command", "layer", "cancel", "readable"),
    list(itertools.product(COMMANDS, LAYERS, CANCELS, [True, False])),
)
def test_decision_table(command: str, layer: str, cancel: str, readable: bool) -> None:
    flag, tombstone = CANCELS[cancel]
    facts = BookFacts(
        registry_readable=readable,
        cancel_flag=flag,
        tombstone=tombstone,
        layers_raw=LAYERS[layer],
        commanded=commanded_for(command) if readable else frozenset(),
    )
    assert decide(facts, PAIR) == expected(command, layer, cancel, readable)


def test_scene_authorization_lists_each_denied_stage() -> None:
    facts = BookFacts(True, layers_raw='{"image_enabled": false}', commanded=frozenset({("c", "s", "image")}))
    auth = authorize_scene(facts, "c", "s", ["audio", "image"])
    assert auth.stages == frozenset()
    assert auth.denied == {"audio": Denial.NO_ACTIVE_TASK, "image": Denial.LAYER_DISABLED}


@pytest.mark.parametrize("raw", [None, "", "[]", "42", "{bad", '"x"', '{"audio_enabled": "no"}'])
def test_unusable_layer_config_enables_everything(raw: str | None) -> None:
    assert parse_layers(raw).get("audio_enabled") is not False


OWNED = {"state": "generating", "token": 7, "owner": "d-7"}
NOT_OWNED = {
    "re-dispatched": {"state": "generating", "token": 8, "owner": "d-8"},
    "released": {"state": "dirty", "token": 7, "owner": "d-7"},
    "settled": {"state": "ready", "token": 7, "owner": "d-7"},
}


@pytest.mark.parametrize(
    ("command", "layer", "cancel"),
    list(itertools.product(COMMANDS, LAYERS, CANCELS)),
)
def test_job_start_agrees_with_the_gate_pass(command: str, layer: str, cancel: str) -> None:
    """The same facts, fed to the pass decision and to the job-start decision of a job that still owns its
    pair, give the same answer: the invariant is decided in one place at dispatch and at job start."""
    flag, tombstone = CANCELS[cancel]
    book = BookFacts(True, flag, tombstone, LAYERS[layer], commanded_for(command))
    start = JobStartFacts(book, found=True, **OWNED)  # type: ignore[arg-type]
    assert decide_job_start(start, PAIR, 7, "d-7") == decide(book, PAIR)


@pytest.mark.parametrize("why", sorted(NOT_OWNED))
def test_a_job_that_no_longer_owns_its_pair_never_starts(why: str) -> None:
    book = BookFacts(True, commanded=frozenset({PAIR}))
    assert decide(book, PAIR) is None  # the pair itself is still authorized
    start = JobStartFacts(book, found=True, **NOT_OWNED[why])  # type: ignore[arg-type]
    assert decide_job_start(start, PAIR, 7, "d-7") == Denial.STALE_TOKEN


def test_job_start_refuses_a_cancelled_book_before_anything_else() -> None:
    book = BookFacts(True, cancel_flag=True, commanded=frozenset({PAIR}))
    assert decide_job_start(JobStartFacts(book, found=False), PAIR, 7, "d-7") == Denial.CANCELLED
    assert decide_job_start(JobStartFacts(BookFacts(True), found=False), PAIR, 7, "d-7") == Denial.UNKNOWN_PAIR


Pair = tuple[str, str, str]
PAIRS: list[Pair] = [(c, s, st) for c in ("ch1", "ch2") for s in ("s1", "s2") for st in ("audio", "image")]


class Row(NamedTuple):
    pair: Pair


COMMANDED: dict[str, frozenset[Pair]] = {
    "none": frozenset(),
    "all": frozenset(PAIRS),
    "audio": frozenset(p for p in PAIRS if p[2] == "audio"),
    "every_other": frozenset(PAIRS[::2]),
}


@pytest.mark.parametrize(
    "commanded,layer,cancel,readable", list(itertools.product(COMMANDED, LAYERS, CANCELS, (True, False)))
)
def test_deciding_a_pass_s_pairs_at_once_agrees_with_deciding_each(
    commanded: str, layer: str, cancel: str, readable: bool
) -> None:
    flag, tombstone = CANCELS[cancel]
    facts = BookFacts(readable, flag, tombstone, LAYERS[layer], COMMANDED[commanded])
    items = [Row(p) for p in reversed(PAIRS)]
    authorized, denied = decide_all(facts, items)
    assert authorized == [i for i in items if decide(facts, i.pair) is None]
    assert denied == {i.pair: decide(facts, i.pair) for i in items if decide(facts, i.pair) is not None}
