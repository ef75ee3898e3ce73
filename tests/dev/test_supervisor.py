"""The process supervisor of the demo, the tests and the benchmarks, on real processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from animastor_tasks.dev.supervisor import Supervisor


def test_a_group_stopped_is_forgotten_so_its_number_reused_later_is_never_killed(tmp_path: Path) -> None:
    """`stop_all` SIGKILLed every group ever started, those stopped hours before included: a number the system
    had given since to another session's leader (a shell, another demo's worker) took that SIGKILL."""
    sup = Supervisor(os.environ, tmp_path / "logs", say=lambda _: None)
    early = sup.start("early", [sys.executable, "-c", "import time; time.sleep(60)"])
    late = sup.start("late", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sup.stop("early", grace=5)
        assert early.pid not in sup.groups and late.pid in sup.groups
        assert sup.started == 2
    finally:
        sup.stop_all(grace=5)
    assert sup.groups == [] and sup.survivors() == []


def test_a_signal_that_python_wrapped_is_still_found() -> None:
    """A Ctrl-C that came while a class was being made (a lazily imported module, mid-send) reached the demo as
    "RuntimeError: Error calling __set_name__", and it exited 1 with a traceback (seen once in CI)."""
    import signal as signals

    from animastor_tasks.dev.supervisor import Interrupted

    class Named:
        def __set_name__(self, owner: type, name: str) -> None:
            raise Interrupted(signals.SIGINT)

    with pytest.raises(RuntimeError) as wrapped:
        type("Made", (), {"field": Named()})
    assert Interrupted.behind(wrapped.value) is not None
    assert Interrupted.behind(wrapped.value).signum == signals.SIGINT  # type: ignore[union-attr]
    assert Interrupted.behind(ValueError("not a signal")) is None
