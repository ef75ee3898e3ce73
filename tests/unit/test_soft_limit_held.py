"""The soft time limit held back while a job writes its verdict: noted, not raised, and raised again after."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
from billiard.pool import SIG_SOFT_TIMEOUT, soft_timeout_sighandler
from celery.exceptions import SoftTimeLimitExceeded

from animastor_tasks.worker.time_limit import soft_limit_held


@pytest.fixture
def prefork_child_handler() -> Iterator[None]:
    """This process's SIGUSR1 as a prefork pool child has it: Celery's soft time limit."""
    previous = signal.signal(SIG_SOFT_TIMEOUT, soft_timeout_sighandler)
    yield
    signal.signal(SIG_SOFT_TIMEOUT, previous)


def _soft_limit() -> None:
    os.kill(os.getpid(), SIG_SOFT_TIMEOUT)
    signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a C call: the Python handler has run when it returns


def test_the_limit_fired_inside_is_noted_not_raised_and_the_handler_comes_back(prefork_child_handler, caplog) -> None:
    with soft_limit_held("job-1"):
        _soft_limit()
    assert signal.getsignal(SIG_SOFT_TIMEOUT) is soft_timeout_sighandler
    assert "job-1 soft time limit passed while its verdict was written" in caplog.text
    with pytest.raises(SoftTimeLimitExceeded):
        _soft_limit()


def test_a_hold_the_limit_does_not_reach_says_nothing(prefork_child_handler, caplog) -> None:
    with soft_limit_held("job-2"):
        pass
    assert "soft time limit passed" not in caplog.text
    assert signal.getsignal(SIG_SOFT_TIMEOUT) is soft_timeout_sighandler


def test_another_handler_and_another_thread_are_left_alone() -> None:
    """No prefork child (a solo worker's SIGUSR1 dumps its threads), or not on the main thread: nothing to hold."""
    before = signal.signal(SIG_SOFT_TIMEOUT, lambda *_: None)
    try:
        with soft_limit_held("job-3"):
            assert signal.getsignal(SIG_SOFT_TIMEOUT) is not soft_timeout_sighandler
        signal.signal(SIG_SOFT_TIMEOUT, soft_timeout_sighandler)
        seen: list[object] = []

        def held_elsewhere() -> None:
            with soft_limit_held("job-4"):
                seen.append(signal.getsignal(SIG_SOFT_TIMEOUT))

        thread = threading.Thread(target=held_elsewhere)
        thread.start()
        thread.join()
        assert seen == [soft_timeout_sighandler]
    finally:
        signal.signal(SIG_SOFT_TIMEOUT, before)
