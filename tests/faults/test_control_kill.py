"""A control worker killed while both its processes are busy: a command it had fetched but not started yet.

With the Redis broker a fetched message waits in the broker's unacked set until it is acked; a worker killed
before it started the task never acks it, and the broker hands it out again only after the visibility
timeout (an hour by default): a `regenerate` the client was told is queued ran an hour late, and a Stop All
sent then would cancel, an hour later, whatever the reader had asked for since.
"""

from __future__ import annotations

import signal
import time

import psycopg
import pytest

from tests.e2e.harness import wait_for
from tests.integration.helpers import make_book

pytestmark = [pytest.mark.faults, pytest.mark.e2e]


def _waiting_on_the_lock(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'"
        ).fetchone()
    return int(row[0]) if row else 0


def test_a_killed_control_worker_strands_no_command_it_had_not_started(make_stack, figure) -> None:
    stack = make_stack()
    cluster, url = stack.cluster, stack.settings.database_url
    control = cluster.control()
    for book in ("held", "behind"):
        stack.rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    with psycopg.connect(url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtext('book:held'))")  # both control processes wait on it
        for _ in range(2):
            stack.client.regenerate("held", ["audio"], wait=False)
        wait_for(lambda: _waiting_on_the_lock(url) >= 2, 20, what="both control processes busy")
        stack.client.regenerate("behind", ["audio"], wait=False)
        time.sleep(1.0)  # time enough to fetch it, were the worker to fetch ahead
        cluster.kill(control, signal.SIGKILL)
    killed = time.monotonic()
    cluster.control()
    wait_for(lambda: stack.rt.ports.commands.commands(book="behind"), 30, what="the command sent behind the busy ones")
    figure(f"control worker SIGKILLed with both processes busy: the command queued behind them ran "
           f"{time.monotonic() - killed:.1f}s later, on its successor")  # fmt: skip
