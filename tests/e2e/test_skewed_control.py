"""A control worker whose host clock is ahead of beat's still runs the ticks: nothing of the schedule is judged by
two hosts' clocks (the runtime's own times go by the Redis server's clock)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from animastor_tasks.operator.metrics import last_tick_age
from tests.support import missing

pytestmark = pytest.mark.e2e

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def test_a_control_worker_whose_clock_is_ahead_of_beats_still_runs_the_ticks(make_stack, figure) -> None:
    """Beat sent each tick with an expiry 10 s ahead by its own clock, and the control worker judged it by its
    clock: a control host 20 s ahead (a second control worker in a rollout, NTP off on one host) dropped every
    tick as expired, and no takeover, stranded slot or due pass ran, beat's healthcheck blaming beat."""
    if not LIBFAKETIME.exists():
        missing("libfaketime is not installed (apt-get install -y faketime)")
    stack = make_stack()
    cluster = stack.cluster
    ahead = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": "+20s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    control = cluster.control(env=ahead, wait=False)
    beat = cluster.beat(wait=False)
    cluster.wait_ready(control, beat)
    started = time.monotonic()
    deadline = started + 4 * stack.settings.tick_seconds + 10
    age = last_tick_age(stack.settings)
    while age is None and time.monotonic() < deadline:
        time.sleep(0.5)
        age = last_tick_age(stack.settings)
    assert age is not None, f"no tick ran; control log: {control.log()[-2000:]}"
    figure(f"control host 20 s ahead of beat: first tick ran {time.monotonic() - started:.1f}s after both were up")
