from __future__ import annotations

import itertools

import pytest

from animastor_tasks.domain.vocabulary import TRANSITIONS, AssetState, can_transition, sources_of, transition
from animastor_tasks.errors import InvalidTransition

ALLOWED = {
    ("dirty", "pending"),
    ("pending", "generating"),
    ("pending", "dirty"),
    ("generating", "ready"),
    ("generating", "failed"),
    ("generating", "pending"),
    ("generating", "dirty"),
    ("ready", "pending"),
    ("ready", "dirty"),
    ("failed", "pending"),
    ("failed", "dirty"),
}


@pytest.mark.parametrize(("source", "target"), list(itertools.product([s.value for s in AssetState], repeat=2)))
def test_every_pair(source: str, target: str) -> None:
    if (source, target) in ALLOWED:
        assert transition(source, target) == AssetState(target)
        assert can_transition(source, target)
    else:
        with pytest.raises(InvalidTransition) as info:
            transition(source, target)
        assert repr(source) in str(info.value) and repr(target) in str(info.value)


def test_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(AssetState)


def test_pending_is_reached_only_from_a_command_or_lease_loss() -> None:
    assert sources_of(AssetState.PENDING) == {
        AssetState.DIRTY,
        AssetState.READY,
        AssetState.FAILED,
        AssetState.GENERATING,
    }
