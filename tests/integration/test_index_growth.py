"""What a farm keeps in Redis must end with the work it stands for: a finished or BLOCKED book leaves the
active index (`P:active-books`, `P:active:B`), whatever else the lanes are busy with.

Real Postgres, Redis and broker; jobs run in-process (`run_job`), control work through the real tasks."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import Later, run_job
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, states
from .test_elastic_share import finish_one, lane, run_control, running, waiting
from .test_generate import dispatched_jobs, with_stage


def tick(rt: Wiring) -> None:
    rt.redis.client.delete(rt.redis.keys.lock("tick"))
    gate.tick(rt.ports)
    run_control(rt)


def audio(rt: Wiring, book: str) -> set[str]:
    return {state for (_, _, stage), state in states(rt, book).items() if stage == "audio"}


def assert_gone(rt: Wiring, book: str) -> None:
    assert book not in rt.ports.book_state.active_books()
    assert rt.redis.client.exists(rt.redis.keys.active_scenes(book)) == 0


def test_a_book_whose_last_job_ends_while_another_waits_leaves_the_active_index(rt: Wiring) -> None:
    """Old code: the slot went to the waiter, the finished book onto the waiting list, and no full pass ran."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    rt.catalog.import_book(make_book("done", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("other", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "done", ["audio"])
    regenerate_flow.regenerate(rt.ports, "other", ["audio"])  # refused lane_full: it waits
    assert running(rt, "done", "other") == {"done": 1}
    finish_one(rt, "done")
    run_control(rt)
    assert running(rt, "done", "other") == {"other": 1}
    assert set(states(rt, "done").values()) == {"ready"}
    assert_gone(rt, "done")
    assert "other" in rt.ports.book_state.active_books()  # its second scene still waits
    finish_one(rt, "other")  # the slot it waited for goes to `done`, which has no use for it: back to `other`
    assert "done" not in waiting(rt) and running(rt, "done", "other") == {"other": 1}
    finish_one(rt, "other")
    run_control(rt)
    assert set(states(rt, "other").values()) == {"ready"}
    assert_gone(rt, "other")


def test_a_book_blocked_at_its_dispatch_leaves_the_active_index(rt: Wiring, tmp_path: Path) -> None:
    """Old code: the blocked pairs counted as busy, and the book stayed active with nothing in flight."""
    spec = replace(rt.settings.registry.get("audio"), params={"steps": 1, "step_seconds": 0})
    with_stage(rt, spec, tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # no worker ever advertised the queue
    assert audio(rt, "b") == {"dirty"}
    assert {c.status for c in rt.ports.commands.commands(book="b")} == {"blocked"}
    tick(rt)
    reconcile_flow.reconcile(rt.ports, force=True)
    assert_gone(rt, "b")


def test_a_book_blocked_by_the_tick_leaves_the_active_index(rt: Wiring, tmp_path: Path) -> None:
    """Old code: block_consumerless released the pairs and touched no index; no pass came after."""
    spec = replace(rt.settings.registry.get("audio"), lease_ttl=60, params={"steps": 1, "step_seconds": 0})
    with_stage(rt, spec, tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert audio(rt, "b") == {"generating"}
    rt.presence.heartbeat("test-worker@local", (), 0, gone=["gpu.audio"])  # its warm shutdown, long ago
    left = rt.redis.server_time() - rt.settings.silent_worker_seconds - 1
    rt.redis.client.zadd(rt.redis.keys.departures(), {"gpu.audio": left})
    tick(rt)
    reconcile_flow.reconcile(rt.ports, force=True)
    assert audio(rt, "b") == {"dirty"}
    assert {c.status for c in rt.ports.commands.commands(book="b")} == {"blocked"}
    assert_gone(rt, "b")


def test_a_jobs_dispatch_metadata_goes_with_its_end(rt: Wiring) -> None:
    """Old code: `P:dispatch:ID` lived 4 days after its job ended (max(4 x the queued lease's day, 24 h))."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    rt.catalog.import_book(make_book("w", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    (first, second) = dispatched_jobs(rt, "b")
    assert rt.redis.client.ttl(rt.redis.keys.dispatch(first.dispatch_id)) > 0
    finish_one(rt, "b")  # nobody waits: the book's own refill
    assert rt.redis.client.ttl(rt.redis.keys.dispatch(first.dispatch_id)) == -2
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])  # refused lane_full: it waits
    finish_one(rt, "b")  # the slot goes to `w`, `b` queued behind it at its job's rank
    assert rt.redis.client.ttl(rt.redis.keys.dispatch(second.dispatch_id)) == -2
    assert running(rt, "b", "w") == {"w": 1}


def test_reconcile_sets_no_flag_for_old_tombstones_of_books_without_work(rt: Wiring) -> None:
    """Old code: every tombstone ever had its flag written again (SET NX), every 30 s, forever."""
    for book in ("s1", "s2", "s3", "busy"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
        cancel_flow.cancel(rt.ports, book)
    with rt.db.transaction() as conn:  # the Stop Alls of long ago, and a pair of `busy` in flight behind its tombstone
        conn.execute("UPDATE cancel_tombstones SET cancelled_at = now() - interval '3 days'")
        conn.execute("UPDATE asset_states SET state = 'pending' WHERE book_id = 'busy' AND stage = 'audio'")
    rt.redis.client.delete(*(rt.redis.keys.cancel_flag(b) for b in ("s1", "s2", "s3", "busy")))
    reconcile_flow.reconcile(rt.ports, force=True)
    assert not any(rt.ports.book_state.cancel_flag_set(b) for b in ("s1", "s2", "s3"))
    assert rt.ports.book_state.cancel_flag_set("busy")  # a job of it could still be dispatched: the flag stands


def test_reconcile_restores_the_flag_of_a_recent_stop_all(rt: Wiring) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    cancel_flow.cancel(rt.ports, "b")
    rt.redis.client.delete(rt.redis.keys.cancel_flag("b"))  # lost with Redis's data
    reconcile_flow.reconcile(rt.ports, force=True)
    assert rt.ports.book_state.cancel_flag_set("b")


def blocked_request(rt: Wiring, aged: str) -> None:
    """One request of audio and image for book `b`, both BLOCKED; the commands `aged` selects last changed 10 days
    ago."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio", "gpu.image")
    regenerate_flow.regenerate(rt.ports, "b", ["audio", "image"], command_id=str(uuid.uuid4()))
    for stage in ("audio", "image"):
        rt.ports.commands.block_stage("b", stage, f"no_worker:{stage}")
    with rt.db.transaction() as conn:
        conn.execute(f"UPDATE commands SET updated_at = now() - interval '10 days' WHERE {aged}")


def test_blocked_commands_past_the_retention_are_pruned(rt: Wiring) -> None:
    """Old code: a BLOCKED command never counted as ended, and pinned its whole request (its targets) for good."""
    blocked_request(rt, "book_id = 'b'")
    assert {c.status for c in rt.ports.commands.commands(book="b")} == {"blocked"}
    assert rt.ports.commands.prune_commands(1, 50_000) == 2
    assert rt.ports.commands.commands(book="b") == []
    with rt.db.read() as conn:
        assert conn.execute("SELECT count(*) FROM command_targets WHERE book_id = 'b'").fetchone()[0] == 0


def test_a_recently_blocked_command_pins_its_request(rt: Wiring) -> None:
    blocked_request(rt, "stage = 'audio'")
    assert rt.ports.commands.prune_commands(1, 50_000) == 0


class _HeldBack(Later):
    """A worker's bookkeeping held back until its next job has started (worker/chain.py): kept, not run."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], object]] = []

    def __call__(self, step: Callable[[], object]) -> None:
        self.steps.append(step)


class _CandidateReads:
    def __init__(self, inner: Any) -> None:
        self.inner, self.books = inner, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def gate_candidates(self, book: str, *args: Any, **kwargs: Any) -> Any:
        self.books.append(book)
        return self.inner.gate_candidates(book, *args, **kwargs)


def test_the_clean_up_of_a_book_that_handed_its_slot_on_waits_for_the_next_job_s_start(rt: Wiring) -> None:
    """The finished book's candidate read (and its full pass) ran before the job returned, so before the job its
    process keeps for the freed slot could start: a Postgres read more between a GPU's two jobs on a busy lane."""
    lane(rt, lane_limit=1, book_quota=1, window=1)
    rt.catalog.import_book(make_book("done", chapters=1, scenes=1))
    rt.catalog.import_book(make_book("other", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "done", ["audio"])
    regenerate_flow.regenerate(rt.ports, "other", ["audio"])  # refused lane_full: it waits
    [job] = dispatched_jobs(rt, "done")
    reads, held = _CandidateReads(rt.ports.assets), _HeldBack()
    rt.ports = replace(rt.ports, assets=reads)
    assert run_job(rt.ports, job, worker="test@local", later=held)["outcome"] == "ready"
    assert "done" not in reads.books and "done" in rt.ports.book_state.active_books()
    for step in held.steps:
        step()
    run_control(rt)
    assert "done" in reads.books
    assert_gone(rt, "done")
