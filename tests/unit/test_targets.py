"""The rules of a command's targets: how a regenerate takes them, why they are released, how a command settles."""

from __future__ import annotations

import pytest

from animastor_tasks.domain.gate import BookFacts
from animastor_tasks.domain.targets import (
    Take,
    TargetCounts,
    regenerate_take,
    release_reason,
    settle,
    states_taking,
    stop_marker,
)
from animastor_tasks.domain.vocabulary import AssetState, CommandStatus, can_transition

PAIR = ("ch1", "s1", "audio")


@pytest.mark.parametrize(
    ("state", "force", "take"),
    [
        ("dirty", False, Take.QUEUE),
        ("ready", False, Take.QUEUE),
        ("failed", True, Take.QUEUE),
        ("pending", True, Take.JOIN),
        ("generating", False, Take.JOIN),  # the running job's commit serves the new command
        ("generating", True, Take.RERUN),  # fenced off and stopped, then a fresh run
    ],
)
def test_what_a_regenerate_does_to_a_target(state: str, force: bool, take: Take) -> None:
    assert regenerate_take(state, force) is take


def test_a_regenerate_never_takes_a_running_pair_to_pending() -> None:
    for force in (False, True):
        queued = states_taking(Take.QUEUE, force)
        assert AssetState.GENERATING not in queued
        assert all(can_transition(s, AssetState.PENDING) for s in queued)
    assert states_taking(Take.RERUN, False) == frozenset()
    assert states_taking(Take.RERUN, True) == {AssetState.GENERATING}


def test_a_stop_marker_is_never_a_dispatch_id() -> None:
    assert stop_marker("ab" * 16) != "ab" * 16 and stop_marker("x").startswith("stopping:")


def test_release_reasons_come_from_the_gate() -> None:
    commanded = frozenset({PAIR})
    off = BookFacts(True, layers_raw='{"audio_enabled": false}', commanded=commanded)
    assert release_reason(off, PAIR) == "layer_disabled"
    # Stop All ends its commands itself: a tombstone, or facts that still authorize (the Redis flag).
    assert release_reason(BookFacts(True, tombstone=True, commanded=commanded), PAIR) is None
    assert release_reason(BookFacts(True, commanded=commanded), PAIR) is None


def test_a_command_settles_only_when_no_target_can_progress() -> None:
    assert settle(TargetCounts(total=3, ready=2)) is None
    assert settle(TargetCounts(total=3, ready=3)) == (CommandStatus.COMPLETED, None)
    assert settle(TargetCounts(total=3, ready=2, failed=1)) == (CommandStatus.FAILED, "1 of 3 targets failed")
    assert settle(TargetCounts(total=20, ready=18, released={"layer_disabled": 2})) == (
        CommandStatus.FAILED,
        "2 of 20 targets released (layer_disabled)",
    )
    assert settle(TargetCounts(total=4, ready=1, failed=1, released={"no_worker:audio": 1, "layer_disabled": 1})) == (
        CommandStatus.FAILED,
        "1 of 4 targets failed; 1 of 4 targets released (layer_disabled); 1 of 4 targets released (no_worker:audio)",
    )
    assert settle(TargetCounts(total=2, ready=1, released={"layer_disabled": 0})) is None
