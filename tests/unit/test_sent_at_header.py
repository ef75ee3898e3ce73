"""The `animastor_sent_at` header of a control message is a number of seconds, or taken as absent: a hand-made
message's header is no part of the task's contract, and one that is no time refuses nothing and voids nothing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from animastor_tasks.domain.registry import SENT_AT_HEADER


@pytest.mark.parametrize("stamp", ["1765000000", True, float("nan"), float("inf"), None, [1.0], {"t": 1}])
def test_a_header_that_is_no_time_is_taken_as_absent(stamp: Any) -> None:
    from animastor_tasks.worker import tasks

    assert tasks._sent_at(SimpleNamespace(**{SENT_AT_HEADER: stamp})) is None
    assert tasks._sent_at(SimpleNamespace()) is None


def test_a_time_is_taken_as_seconds() -> None:
    from animastor_tasks.worker import tasks

    assert tasks._sent_at(SimpleNamespace(**{SENT_AT_HEADER: 1765000000})) == 1765000000.0
    assert tasks._sent_at(SimpleNamespace(**{SENT_AT_HEADER: 1765000000.25})) == 1765000000.25
