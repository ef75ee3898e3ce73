"""A regenerate that names a scene while its job runs: the real flows, jobs run in-process in a thread.

Without force the running job serves the new command; with force it is fenced off and stopped,
its slot keeps counting until it has stopped, and only then is a fresh run dispatched.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from animastor_tasks.domain.targets import stop_marker
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, refill, takeover
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.flow.job import Job
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, queued_messages, states, use_settings
from .test_generate import dispatched_jobs, with_stage

PAIR = ("ch1", "s1", "audio")


def audio(rt: Wiring, tmp_path: Path, **spec: Any) -> None:
    with_stage(rt, replace(rt.settings.registry.get("audio"), **spec), tmp_path)


def in_thread(rt: Wiring, job: Job) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.update(run_job(rt.ports, job, worker="test")))
    thread.start()
    return thread, outcome


def a_running_job(rt: Wiring, text: str = "Once upon a time") -> tuple[Job, threading.Thread, dict[str, Any]]:
    """One audio scene regenerated and its job started in a thread (its start check passed: it read the text)."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1, text=text))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    taken_by_worker(rt)
    thread, outcome = in_thread(rt, job)
    time.sleep(0.3)
    return job, thread, outcome


def taken_by_worker(rt: Wiring) -> None:
    """The jobs run in-process: their messages are taken off the queue as a worker would."""
    rt.redis.client.delete("gpu.audio")


def dispatch_events(rt: Wiring) -> int:
    with rt.db.transaction() as conn:
        return int(conn.execute("SELECT count(*) FROM events WHERE kind = 'dispatch'").fetchone()[0])


def status_of(rt: Wiring, command_id: str) -> str:
    return {c.command_id: c.status for c in rt.ports.commands.commands(book="b")}[command_id]


def test_regenerate_without_force_during_a_run_is_served_by_that_run(rt, tmp_path) -> None:
    audio(rt, tmp_path, params={"steps": 10, "step_seconds": 0.1})
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    first = regenerate_flow.regenerate(rt.ports, "b", ["audio"])["commands"][0]["command_id"]
    [job] = dispatched_jobs(rt, "b")
    taken_by_worker(rt)
    thread, outcome = in_thread(rt, job)
    time.sleep(0.3)
    second = regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=False)["commands"][0]["command_id"]
    # The pair stays with its running job: same dispatch, same token, nothing new queued.
    assert dispatched_jobs(rt, "b") == [job]
    assert queued_messages(rt, "gpu.audio") == 0
    thread.join(timeout=10)
    assert outcome["outcome"] == "ready", outcome  # its commit is not fenced off
    assert states(rt, "b")[PAIR] == "ready"
    assert status_of(rt, first) == "completed" and status_of(rt, second) == "completed"
    assert rt.redis.client.zcard(rt.redis.keys.deferrals("b", "idempotent")) == 0  # no 15-minute stall


def test_forced_regenerate_during_a_run_stops_it_and_runs_fresh_once_it_stopped(rt, tmp_path) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    # A first output, so a later pass could wrongly settle the pair as already completed.
    audio(rt, tmp_path)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [ready_job] = dispatched_jobs(rt, "b")
    assert run_job(rt.ports, ready_job, worker="test")["outcome"] == "ready"
    taken_by_worker(rt)

    # A slow run, renewing its lease every second.
    audio(rt, tmp_path, params={"steps": 60, "step_seconds": 0.1}, lease_ttl=3)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    taken_by_worker(rt)
    thread, outcome = in_thread(rt, job)
    time.sleep(0.3)
    dispatches = dispatch_events(rt)
    forced = regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)["commands"][0]["command_id"]

    # Nothing new is dispatched while the old job holds the GPU: the pair stays generating (its slot
    # counts), under a token the old job no longer holds, and no second job is queued.
    assert dispatch_events(rt) == dispatches and queued_messages(rt, "gpu.audio") == 0
    [fenced] = dispatched_jobs(rt, "b")
    assert fenced.dispatch_id == job.dispatch_id and fenced.fencing_token == job.fencing_token + 1
    with rt.ports.assets.claiming("b", {"audio": "gpu.audio"}) as session:
        assert session.counts.lane.get("audio") == 1
    thread.join(timeout=5)
    assert outcome["outcome"] == "stopped", outcome  # told to stop; nothing committed

    # As it returned, the stopped job let go of its stop marker and its end took the pair over: a fresh run goes
    # out, even after the force window has closed (no "already completed").
    assert not rt.redis.client.exists(rt.redis.keys.lease("b", *PAIR))
    assert status_of(rt, forced) == "active" and states(rt, "b")[PAIR] == "pending"
    rt.redis.client.delete(rt.redis.keys.force_set("b"))
    assert reconcile_flow.reconcile(rt.ports, force=True)["expired"] == 0  # nothing left for reconcile
    assert len(gate.gate_pass(rt.ports, "b").dispatched) == 1
    [fresh] = dispatched_jobs(rt, "b")
    assert fresh.dispatch_id != job.dispatch_id and fresh.fencing_token == job.fencing_token + 2
    audio(rt, tmp_path, lease_ttl=3)
    assert run_job(rt.ports, fresh, worker="test")["outcome"] == "ready"
    assert status_of(rt, forced) == "completed"
    with rt.db.transaction() as conn:
        committed = [r[0] for r in conn.execute("SELECT dispatch_id FROM artifacts ORDER BY id")]
    assert committed == [ready_job.dispatch_id, fresh.dispatch_id]


def test_a_forced_regenerate_stops_the_running_job_at_once_not_at_its_next_renewal(rt, tmp_path) -> None:
    """The stop marker was seen only at the job's next lease renewal, a third of a lease TTL away (40 s by default):
    the fenced-off job ran on meanwhile, its GPU slot doing work that was thrown away, while the reader's fresh run
    waited for it to stop."""
    audio(rt, tmp_path, params={"steps": 100, "step_seconds": 0.1}, lease_ttl=60)
    _, thread, outcome = a_running_job(rt)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
    told = time.monotonic()
    thread.join(timeout=3)
    assert not thread.is_alive(), "the fenced-off job still runs 3 s after the forced regenerate"
    assert outcome["outcome"] == "stopped" and outcome["reason"] == "superseded by a forced regenerate", outcome
    assert time.monotonic() - told < 1.5


def test_a_stop_all_followed_at_once_by_a_regenerate_still_stops_the_running_job(rt, tmp_path) -> None:
    """Stop All let go of the job's lease and set the flag; a regenerate right after lifted the flag and claimed the
    pair anew before the watcher's next poll. The watcher acted only on the flag and its own stop marker, so the old
    job ran on to its next renewal (40 s by default) beside the fresh run's dispatch, the lane one over full, its
    output refused at its commit (a concurrency hunt: 6 of 6)."""
    audio(rt, tmp_path, params={"steps": 100, "step_seconds": 0.1}, lease_ttl=60)
    job, thread, outcome = a_running_job(rt)
    cancel_flow.cancel(rt.ports, "b")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    thread.join(timeout=3)
    assert not thread.is_alive(), "the old job still runs 3 s after the Stop All"
    assert outcome["outcome"] == "stopped", outcome
    [fresh] = dispatched_jobs(rt, "b")
    assert fresh.dispatch_id != job.dispatch_id
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [fresh.dispatch_id]  # the fresh run's, left to it


def test_a_stopped_jobs_pair_is_taken_over_as_the_job_ends_not_at_the_next_tick(rt, tmp_path) -> None:
    """The pair the fenced-off job left `generating` waited for the tick's takeover (up to 5 s) with its slot idle,
    the reader's fresh run behind it. Now the job's end takes it over: `pending`, its book at the head of the lane's
    waiting list and the freed slot handed to it (a refill on the control queue), as the tick would."""
    audio(rt, tmp_path, params={"steps": 100, "step_seconds": 0.1}, lease_ttl=60)
    job, thread, outcome = a_running_job(rt)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
    control = queued_messages(rt, "animastor.control")
    thread.join(timeout=3)
    assert outcome.get("outcome") == "stopped", outcome
    assert states(rt, "b")[PAIR] == "pending"
    assert queued_messages(rt, "animastor.control") > control  # the slot handed on: a refill of the book
    assert len(gate.gate_pass(rt.ports, "b").dispatched) == 1
    [fresh] = dispatched_jobs(rt, "b")
    assert fresh.dispatch_id != job.dispatch_id and fresh.fencing_token == job.fencing_token + 2


def test_a_fenced_job_that_finishes_first_does_not_complete_the_forced_command(rt, tmp_path, monkeypatch) -> None:
    """The old job ends before its watcher saw its stop marker: its output is refused, the forced command waits for a
    fresh run (the watcher looks no sooner than its next renewal here, 20 s away). Its pair is taken over as it ends:
    left `generating`, it waited for the tick with its slot idle."""
    audio(rt, tmp_path, params={"steps": 8, "step_seconds": 0.1}, lease_ttl=60)
    job, thread, outcome = a_running_job(rt)
    monkeypatch.setattr(rt.ports.leases, "watch", lambda _pair, _book: (job.dispatch_id, False))  # sees nothing
    forced = regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)["commands"][0]["command_id"]
    thread.join(timeout=5)
    assert outcome["outcome"] == "fence_rejected", outcome
    assert states(rt, "b")[PAIR] == "pending" and status_of(rt, forced) == "active"
    with rt.db.transaction() as conn:
        assert conn.execute("SELECT count(*) FROM artifacts").fetchone()[0] == 0


def one_queued_job(rt: Wiring, tmp_path: Path, **params: Any) -> Job:
    """A one-scene book regenerated once: its job published (lease TTL 60 s), not yet taken by any worker."""
    audio(rt, tmp_path, params=params, lease_ttl=60)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    return job


def dispatched_after_a_tick(rt: Wiring) -> Job:
    """The pair's job once the tick has taken over what nothing holds, and a gate pass has run."""
    takeover.on_tick(rt.ports)
    rt.redis.client.delete(rt.redis.keys.deferrals("b", "capacity"))
    gate.gate_pass(rt.ports, "b")
    [job] = dispatched_jobs(rt, "b")
    return job


def forced_over_while_it_runs(rt: Wiring, job: Job) -> None:
    """Book b's `job` runs in a thread; a forced regenerate of its scene stops it, and it returns."""
    taken_by_worker(rt)
    thread, outcome = in_thread(rt, job)
    time.sleep(0.3)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
    thread.join(timeout=5)
    assert outcome["outcome"] in ("fence_rejected", "stopped"), outcome


def test_the_slot_of_a_fenced_job_is_taken_over_on_the_first_tick_after_it_returned(rt, tmp_path) -> None:
    """A job fenced off by a forced regenerate that returns before its watcher's next renewal (every job shorter than
    a third of the lease TTL) left its stop marker in the pair's lease: nothing renewed it and nothing released it,
    so the pair kept its GPU slot, idle, for a whole lease TTL (60 s here, 120 s by default) before the fresh run."""
    job = one_queued_job(rt, tmp_path, steps=8, step_seconds=0.1)
    forced_over_while_it_runs(rt, job)
    assert not rt.redis.client.exists(rt.redis.keys.lease("b", *PAIR))  # nothing of the old job holds the slot
    assert dispatched_after_a_tick(rt).dispatch_id != job.dispatch_id


def test_a_queued_job_a_forced_regenerate_supersedes_gives_its_slot_back_on_the_next_tick(rt, tmp_path) -> None:
    """A job still queued when a forced regenerate named its scene got a stop marker, as a running one does: nothing
    runs to return from it (revoked, or refused at its start), so the pair held its slot, idle, for a lease TTL."""
    queued = one_queued_job(rt, tmp_path, steps=1, step_seconds=0)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
    fresh = dispatched_after_a_tick(rt)
    assert fresh.dispatch_id != queued.dispatch_id and fresh.fencing_token > queued.fencing_token
    taken_by_worker(rt)
    assert run_job(rt.ports, queued, worker="test")["outcome"] == "fence_rejected"  # the old message, if it comes
    assert run_job(rt.ports, fresh, worker="test")["outcome"] == "ready"


def test_a_queued_job_a_forced_regenerate_withdraws_is_replaced_by_that_regenerate_not_the_next_tick(
    rt, tmp_path
) -> None:
    """Its lease withdrawn, the pair stayed `generating` for the next tick's takeover (up to 5 s, every queued job of a
    whole-book forced regenerate): its slot idle, the reader's fresh run behind it. The regenerate takes it over and
    its own first pass dispatches the fresh run."""
    queued = one_queued_job(rt, tmp_path, steps=1, step_seconds=0)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
    [fresh] = dispatched_jobs(rt, "b")
    assert fresh.dispatch_id != queued.dispatch_id and fresh.fencing_token == queued.fencing_token + 2


def test_the_takeover_a_forced_regenerate_makes_is_logged_as_a_takeover_of_a_stopped_job(rt, tmp_path, caplog) -> None:
    """Old code: the line said `[RECONCILE]`, though the regenerate took the pair over, and the operations guide sends
    operators to `[TAKEOVER]` for lapsed leases taken over. Then it said `lease gone` at WARNING, as of a lost worker's
    job (HA hunt): a reader's forced regenerate is no fault."""
    one_queued_job(rt, tmp_path, steps=1, step_seconds=0)
    with caplog.at_level(logging.INFO, logger="animastor"):
        regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
    [line] = [r for r in caplog.records if r.getMessage().startswith("[TAKEOVER]")]
    assert line.getMessage().startswith("[TAKEOVER] book='b'") and line.levelno == logging.INFO
    assert line.getMessage().endswith("job stopped: generating -> pending")


def test_reconcile_gives_no_lease_back_to_a_queued_job_a_forced_regenerate_superseded(
    rt, tmp_path, monkeypatch
) -> None:
    """Its revoked message still lay in the queue, so reconcile took the job for one still waiting and restored its
    lease for a queued lease's day; the worker then dropped the revoked message unrun, and the pair kept its slot,
    idle, with its command active, for that day."""
    monkeypatch.setattr(reconcile_flow, "RECOUNT_PAUSE_SECONDS", 0.0)
    queued = one_queued_job(rt, tmp_path, steps=1, step_seconds=0)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
    reconcile_flow.reconcile(rt.ports, force=True)
    assert rt.ports.leases.lease_holders([queued.lease_pair]) != [queued.dispatch_id]
    taken_by_worker(rt)  # a worker takes the revoked message and drops it unrun
    fresh = dispatched_after_a_tick(rt)
    assert fresh.dispatch_id != queued.dispatch_id
    assert run_job(rt.ports, fresh, worker="test")["outcome"] == "ready"


def test_reconcile_gives_no_lease_back_to_a_pair_stop_all_released_meanwhile(rt, tmp_path, monkeypatch) -> None:
    """Reconcile read the pair `generating` with its job still queued; Stop All then released it (`dirty`, lease
    dropped) before reconcile restored that lease: a `dirty` pair held a queued lease's day, and every regenerate
    without force was deferred as `already_generating` for all of it."""
    monkeypatch.setattr(reconcile_flow, "RECOUNT_PAUSE_SECONDS", 0.0)
    queued = one_queued_job(rt, tmp_path, steps=1, step_seconds=0)
    restore = rt.ports.leases.restore_leases

    def stop_all_first(*args: Any, **kwargs: Any) -> Any:
        cancel_flow.cancel(rt.ports, "b")
        return restore(*args, **kwargs)

    monkeypatch.setattr(rt.ports.leases, "restore_leases", stop_all_first)
    reconcile_flow.reconcile(rt.ports, force=True)
    assert states(rt, "b")[PAIR] == "dirty"
    assert rt.ports.leases.lease_holders([queued.lease_pair]) == [None]


def test_reconcile_gives_no_lease_back_to_a_job_a_forced_regenerate_superseded_meanwhile(
    rt, tmp_path, monkeypatch
) -> None:
    """Reconcile read the pair (its token) before a forced regenerate fenced the queued job off and withdrew its
    lease: the restore, on the token it had read, matched the dispatch's and gave the lease back for a day."""
    monkeypatch.setattr(reconcile_flow, "RECOUNT_PAUSE_SECONDS", 0.0)
    queued = one_queued_job(rt, tmp_path, steps=1, step_seconds=0)
    restore = rt.ports.leases.restore_leases

    def forced_regenerate_first(*args: Any, **kwargs: Any) -> Any:
        regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
        return restore(*args, **kwargs)

    monkeypatch.setattr(rt.ports.leases, "restore_leases", forced_regenerate_first)
    # The regenerate's own takeover of the withdrawn pair left out (a store that failed it): the pair left to the tick.
    monkeypatch.setattr(takeover, "take_over_stopped", lambda *_: None)
    reconcile_flow.reconcile(rt.ports, force=True)
    monkeypatch.undo()
    assert rt.ports.leases.lease_holders([queued.lease_pair]) == [None]
    taken_by_worker(rt)  # the revoked message is dropped unrun
    assert dispatched_after_a_tick(rt).dispatch_id != queued.dispatch_id


def test_a_lease_left_by_a_claim_that_never_committed_does_not_hold_the_pair(rt, tmp_path) -> None:
    """The claim's leases are written before its COMMIT; one that then failed, with Redis unreachable for the lease
    drop too, left a lease of a dispatch that never was. The pair, pending, was skipped by every pass as claimed by
    a concurrent one, for a queued lease's day, and its book was passed again on every tick."""
    job = one_queued_job(rt, tmp_path, steps=1, step_seconds=0)
    taken_by_worker(rt)
    assert run_job(rt.ports, job, worker="test")["outcome"] == "ready"
    rt.ports.leases.take_leases([(job.lease_pair, "never-committed", 86400, {})])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert states(rt, "b")[PAIR] == "generating"
    [fresh] = dispatched_jobs(rt, "b")
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [fresh.dispatch_id]


def test_a_running_job_that_ends_while_a_forced_regenerate_stops_it_leaves_no_marker(rt, tmp_path, monkeypatch) -> None:
    """The regenerate read the lease as the job's and the job as running, then set the stop marker unconditionally:
    a job that ended in between (its commit refused, its lease and marker released) left a marker nothing would
    release, and the pair's slot idled for its lease TTL."""
    job = one_queued_job(rt, tmp_path, steps=1, step_seconds=0)
    taken_by_worker(rt)
    held, owned, *_ = rt.ports.leases.start_delivery(job.lease_pair, job.dispatch_id, "audio@host#1", 60)
    assert held and owned
    ended: list[bool] = []

    def job_ends() -> None:  # as `_Delivered.end` does
        rt.ports.leases.release_lease(job.lease_pair, job.dispatch_id)
        rt.ports.leases.release_lease(job.lease_pair, stop_marker(job.dispatch_id))
        rt.ports.leases.end_delivery(job.dispatch_id)
        ended.append(True)

    read = rt.ports.leases.delivery_holders

    def read_then_the_job_ends(dispatch_ids: Any) -> Any:
        seen = read(dispatch_ids)
        job_ends()
        return seen

    monkeypatch.setattr(rt.ports.leases, "delivery_holders", read_then_the_job_ends)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
    if not ended:
        job_ends()  # it ends now, after the regenerate
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [None]


def test_a_job_superseded_between_its_delivery_and_its_start_check_leaves_no_marker(rt, tmp_path, monkeypatch) -> None:
    """The forced regenerate lands after the delivery took its running marker, before its start check: the job is
    refused (stale token) and its stop marker, which nothing would renew or release, goes with it."""
    job = one_queued_job(rt, tmp_path, steps=1, step_seconds=0)
    taken_by_worker(rt)
    deliver = rt.ports.leases.start_delivery

    def delivered_then_forced(*args: Any) -> Any:
        found = deliver(*args)
        regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
        return found

    monkeypatch.setattr(rt.ports.leases, "start_delivery", delivered_then_forced)
    assert run_job(rt.ports, job, worker="test")["outcome"] == "fence_rejected"
    assert not rt.redis.client.exists(rt.redis.keys.lease("b", *PAIR))
    assert dispatched_after_a_tick(rt).dispatch_id != job.dispatch_id


def test_a_forced_regenerate_re_makes_a_ready_scene_that_waits_past_the_force_window(rt, tmp_path) -> None:
    """Force lived in Redis for `force_ttl_seconds` only: a ready scene of a forced command that could not start
    within the window (its book capped, a busy lane) was settled `already_completed` from its old media, and the
    command ended `completed` with half the book not made again."""
    audio(rt, tmp_path, params={"steps": 1, "step_seconds": 0})
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    for job in dispatched_jobs(rt, "b"):
        taken_by_worker(rt)
        result = run_job(rt.ports, job, worker="test")
        assert result["outcome"] == "ready", result
    assert {v for p, v in states(rt, "b").items() if p[2] == "audio"} == {"ready"}
    spec = rt.settings.registry.get("audio")
    audio(rt, tmp_path, params=spec.params, book_cap=1)
    use_settings(rt, replace(rt.settings, force_ttl_seconds=1))
    forced = regenerate_flow.regenerate(rt.ports, "b", ["audio"])["commands"][0]["command_id"]  # force: the default
    [first] = dispatched_jobs(rt, "b")  # the cap: one at a time
    taken_by_worker(rt)
    time.sleep(1.2)  # the force window passes while the second scene waits
    result = run_job(rt.ports, first, worker="test")
    assert result["outcome"] == "ready", result
    rt.redis.client.delete(rt.redis.keys.deferrals("b", "capacity"))
    gate.gate_pass(rt.ports, "b")
    other = ("ch1", "s2" if first.pair[1] == "s1" else "s1", "audio")
    assert [j.pair for j in dispatched_jobs(rt, "b")] == [other], states(rt, "b")  # not settled from its old media
    [second] = dispatched_jobs(rt, "b")
    taken_by_worker(rt)
    assert run_job(rt.ports, second, worker="test")["outcome"] == "ready"
    assert status_of(rt, forced) == "completed"
    with rt.db.transaction() as conn:
        made = conn.execute("SELECT count(*) FROM events WHERE kind = 'job.ready' AND book_id = 'b'").fetchone()[0]
    assert made == 4  # both scenes, twice


def test_a_job_fenced_off_inside_a_long_backend_call_keeps_its_slot_until_it_returns(rt, tmp_path) -> None:
    """A forced regenerate swaps the running job's lease for a stop marker of one lease TTL. A job blocked in its
    backend (an HTTP read of minutes) cannot stop before the call returns; once the marker lapsed, the tick took
    the pair over and a second run of the scene started beside the first, the lane counting one slot."""
    from animastor_tasks.flow import takeover

    from .test_job_troubles import _Scripted, _use_generator

    audio(rt, tmp_path, lease_ttl=3)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    released = threading.Event()
    _use_generator(rt, _Scripted(lambda request, progress: released.wait(20)))  # deaf to should_stop
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    taken_by_worker(rt)
    thread, outcome = in_thread(rt, job)
    time.sleep(0.3)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=True)
    time.sleep(4.5)  # more than the stop marker's lease TTL, the job still inside its backend call
    takeover.on_tick(rt.ports)
    gate.gate_pass(rt.ports, "b")
    [held] = dispatched_jobs(rt, "b")
    assert held.dispatch_id == job.dispatch_id, "a second run started while the first still ran"
    released.set()
    thread.join(timeout=10)
    assert outcome["outcome"] == "stopped", outcome
    # Once it has returned, its hold ends with it: the pair goes out again at the next tick, not a lease TTL later.
    takeover.on_tick(rt.ports)
    gate.gate_pass(rt.ports, "b")
    [fresh] = dispatched_jobs(rt, "b")
    assert fresh.dispatch_id != job.dispatch_id


def test_a_forced_rerun_keeps_its_slot_when_another_book_waits_for_the_lane(rt, tmp_path) -> None:
    """Once its fenced-off job has stopped, a forced re-run is dispatched on the slot that job held (design: it keeps
    its slot until it has stopped, and the fresh run goes out as it returns). The takeover handed that slot to the
    head of the lane's waiting list instead: a reader who asked to redo a scene waited behind every book on the list."""
    audio(rt, tmp_path, params={"steps": 8, "step_seconds": 0.1}, lane_limit=1, lease_ttl=60)
    for book in ("b", "w"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])  # lane full: w waits for it
    waiters = rt.redis.keys.lane_waiters("gpu.audio")
    assert rt.redis.client.zrange(waiters, 0, -1) == ["w"]
    [job] = dispatched_jobs(rt, "b")
    forced_over_while_it_runs(rt, job)
    assert states(rt, "b")[PAIR] in ("pending", "generating")  # taken over as the stopped job ended, or by the tick
    takeover.on_tick(rt.ports)
    assert states(rt, "b")[PAIR] == "pending"
    assert rt.redis.client.zrange(waiters, 0, -1) == ["w"]  # w still waits: the slot was not handed to it
    refill.refill(rt.ports, "b", "gpu.audio")  # the refill the slot was handed to, as the control worker runs it
    assert states(rt, "b")[PAIR] == "generating" and states(rt, "w")[PAIR] == "pending"
    assert dispatched_jobs(rt, "b")[0].dispatch_id != job.dispatch_id


def test_regenerate_without_force_after_a_re_import_does_not_join_a_run_of_the_old_text(rt, tmp_path) -> None:
    """The running job read the old text at its start; a reader who re-imported the scene and asked without force
    was joined to it, and its commit completed the new command with media made from the old text."""
    audio(rt, tmp_path, params={"steps": 60, "step_seconds": 0.1}, lease_ttl=3)
    job, thread, outcome = a_running_job(rt, text="The old words")
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1, text="The new words"))
    second = regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=False)["commands"][0]["command_id"]
    [fenced] = dispatched_jobs(rt, "b")
    assert fenced.fencing_token == job.fencing_token + 1  # fenced off, as a forced regenerate does
    thread.join(timeout=10)
    assert outcome["outcome"] in ("stopped", "fence_rejected"), outcome  # nothing of the old text committed
    assert status_of(rt, second) == "active"
    assert states(rt, "b")[PAIR] != "ready"


def test_regenerate_without_force_joins_a_run_of_the_scenes_current_text(rt, tmp_path) -> None:
    """A re-import that left the scene's text as it was changes nothing: the run is joined as before."""
    audio(rt, tmp_path, params={"steps": 10, "step_seconds": 0.1})
    job, thread, outcome = a_running_job(rt)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    second = regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=False)["commands"][0]["command_id"]
    assert dispatched_jobs(rt, "b") == [job]
    thread.join(timeout=10)
    assert outcome["outcome"] == "ready", outcome
    assert status_of(rt, second) == "completed"
