"""A real control worker takes a reader's interactive scene and a Stop All ahead of a backlog of normal and bulk
regenerates, and a regenerate that a Stop All sent after it overtook is void, not run."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.integration.helpers import make_book
from tests.support import wait_for

pytestmark = pytest.mark.e2e

BACKLOG = 60


def _created(stack: Any) -> list[tuple[str, str, str]]:
    with stack.rt.db.read() as conn:
        rows = conn.execute("SELECT book_id, priority, status FROM commands ORDER BY created_at, command_id").fetchall()
    return [(str(b), str(p), str(s)) for b, p, s in rows]


def test_a_reader_s_scene_and_a_stop_all_pass_a_backlog_of_regenerates(make_stack, figure) -> None:
    stack = make_stack()
    for i in range(BACKLOG):
        stack.rt.catalog.import_book(make_book(f"bulk{i:03d}", chapters=1, scenes=1))
    stack.rt.catalog.import_book(make_book("reader", chapters=1, scenes=2))
    stack.rt.catalog.import_book(make_book("stopped", chapters=1, scenes=1))
    # Sent while no control worker runs, as a burst waits behind a busy one: the backlog first, then the reader's
    # scene; and a regenerate of `stopped` with its Stop All sent after it.
    for i in range(BACKLOG):
        stack.client.regenerate(f"bulk{i:03d}", ["audio"], priority="bulk" if i % 2 else "normal", wait=False)
    stopped = stack.client.regenerate("stopped", ["audio"], wait=False)
    stack.client.cancel("stopped", wait=False)
    reader = stack.client.regenerate("reader", ["audio"], [["ch1", "s1"]], priority="interactive", wait=False)
    began = time.monotonic()
    stack.cluster.control()
    wait_for(lambda: len(_created(stack)) >= BACKLOG + 1, 60, what="every regenerate taken")
    took = time.monotonic() - began
    order = [book for book, _, _ in _created(stack)]
    # Two control processes: the reader's command among the first two, not after the backlog sent before it.
    assert order.index("reader") <= 1, order[:5]
    assert "stopped" not in order, order  # taken after the Stop All sent after it: void
    answer = stack.client.app.AsyncResult(stopped["task_id"]).get(timeout=30)
    assert answer == {"commands": [], "skipped": [{"stage": "audio", "reason": "stopped"}]}
    assert stack.client.app.AsyncResult(reader["task_id"]).get(timeout=30)["commands"]
    figure(
        f"{BACKLOG} regenerates queued ahead of a reader's scene: its command was number {order.index('reader') + 1}"
        f" of {len(order)} taken ({took:.1f}s to take them all)"
    )
