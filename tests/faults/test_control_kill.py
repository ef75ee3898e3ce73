"""A control worker killed while both its processes are busy: a command it had fetched but not started yet.

With the Redis broker a fetched message waits in the broker's unacked set until it is acked; a worker killed
before it started the task never acks it, and the broker hands it out again only after the visibility
timeout (an hour by default): a `regenerate` the client was told is queued ran an hour late, and a Stop All
sent then would cancel, an hour later, whatever the reader had asked for since.

And a control worker killed running a gate batch (control tasks are acknowledged when they start): the batch had
taken its books off the due index, and they waited for reconcile's round, their work pending, unless its hold
lapsed and the tick sent their passes again (flow/pass_hold.py).
"""

from __future__ import annotations

import signal
import time

import psycopg
import pytest

from animastor_tasks.flow import pass_hold
from animastor_tasks.flow import regenerate as regenerate_flow
from tests.e2e.harness import audio_stage, stage_table, wait_for
from tests.integration.helpers import make_book

pytestmark = [pytest.mark.faults, pytest.mark.e2e]


def _waiting_on_the_lock(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'"
            " AND datname = current_database()"
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


def test_a_gate_batch_killed_with_its_control_worker_is_sent_again(make_stack, figure) -> None:
    """The tick's batch of one due book, its pass waiting for the lane lock (held here), its control worker
    SIGKILLed: nothing else carries the book (no refill, no hand-over, on no waiting list) and reconcile is an
    hour away. Before the batch's hold: the pair stayed pending, nothing dispatched."""
    stack = make_stack(stages=stage_table(audio=audio_stage()), reconcile_seconds=3600)
    cluster, url, rt = stack.cluster, stack.settings.database_url, stack.rt
    control = cluster.control()
    rt.catalog.import_book(make_book("lost", chapters=1, scenes=1))
    # Regenerated as Redis had just come back here, before any audio worker beat: presence unsure, the first pass
    # holds the pair and asks the tick for the book's pass (the due index); the book waits on no lane's list.
    rt.redis.recovered_at = rt.ports.clock()
    regenerate_flow.regenerate(rt.ports, "lost", ["audio"])
    rt.redis.recovered_at = float("-inf")
    assert rt.redis.client.zscore(rt.redis.keys.due(), "lost") is not None
    [pair] = stack.states("lost")
    cluster.gpu("audio")
    with psycopg.connect(url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtext('lane:gpu.audio'))")  # the batch's claim waits on it
        cluster.beat()  # its first reconcile passes the book too (dispatching nothing), and may make it due again

        def only_batches_carry_it() -> bool:
            text = control.log()
            reconciled = any("Task animastor.reconcile[" in ln and " succeeded " in ln for ln in text.splitlines())
            return (
                reconciled
                and "Task animastor.gate_batch[" in text
                and _waiting_on_the_lock(url) >= 1
                and rt.redis.client.zscore(rt.redis.keys.due(), "lost") is None
            )

        wait_for(only_batches_carry_it, 20, what="the tick's batches waiting for the lane lock, the book due no more")
        time.sleep(1.5)  # a tick more: nothing made the book due again meanwhile
        assert only_batches_carry_it()
        cluster.kill(control, signal.SIGKILL)
    killed = time.monotonic()
    cluster.control()
    wait_for(
        lambda: stack.states("lost")[pair] == "ready",
        pass_hold.HOLD_SECONDS + 15,
        what="the book's pass sent again and its job run",
    )
    assert len(stack.events("dispatch", "lost")) == 1
    took, hold = time.monotonic() - killed, pass_hold.HOLD_SECONDS
    figure(f"control worker SIGKILLed running the tick's gate batch (reconcile an hour away): its book passed "
           f"again, its job ready {took:.1f}s later (hold {hold:.0f}s)")  # fmt: skip
