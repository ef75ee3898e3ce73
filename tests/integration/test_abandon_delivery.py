"""What a worker's main process frees when one of its pool processes dies mid-job (`LeaseStore.abandon_delivery`,
on the real Redis): only what that process still held, the lease only where no redelivery will run the job."""

from __future__ import annotations

from animastor_tasks.adapters.redis.leases import LeaseStore
from animastor_tasks.domain.targets import stop_marker
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.job import Job
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book
from .test_generate import dispatched_jobs, with_stage

DEAD, OTHER = "audio@gpu-1#101", "audio@gpu-2#202"


def _dispatched_job(rt: Wiring, tmp_path) -> Job:
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    return job


def _started_job(rt: Wiring, tmp_path, holder: str = DEAD) -> Job:
    job = _dispatched_job(rt, tmp_path)
    assert rt.ports.leases.start_delivery(job.lease_pair, job.dispatch_id, holder, 120)[:2] == (True, True)
    return job


def _lease(rt: Wiring, job: Job) -> str | None:
    return rt.redis.client.get(rt.redis.keys.lease(*job.lease_pair))


def test_the_redelivered_job_keeps_its_lease_as_it_is_and_its_redelivery_runs(rt, tmp_path) -> None:
    """Never a longer lease: the process may have died after its job committed, before it released the lease,
    and Celery then acknowledges the message instead of redelivering it (the task's success was stored)."""
    job = _started_job(rt, tmp_path)
    assert LeaseStore(rt.redis).abandon_delivery(DEAD, redelivered=job.dispatch_id) == (job.dispatch_id, "audio", False)
    assert _lease(rt, job) == job.dispatch_id
    assert 0 < rt.redis.client.ttl(rt.redis.keys.lease(*job.lease_pair)) <= 120
    assert rt.ports.leases.start_delivery(job.lease_pair, job.dispatch_id, OTHER, 120)[:2] == (True, True)
    assert LeaseStore(rt.redis).abandon_delivery(DEAD, redelivered=job.dispatch_id) is None  # entry gone


def test_a_job_no_message_will_bring_back_gives_up_its_lease(rt, tmp_path) -> None:
    job = _started_job(rt, tmp_path)
    assert LeaseStore(rt.redis).abandon_delivery(DEAD, redelivered="another-dispatch") == (
        job.dispatch_id,
        "audio",
        True,
    )
    assert _lease(rt, job) is None
    assert not rt.redis.client.exists(rt.redis.keys.running(job.dispatch_id))


def test_a_fenced_jobs_stop_marker_goes_even_when_its_message_comes_back(rt, tmp_path) -> None:
    job = _started_job(rt, tmp_path)
    rt.redis.client.set(rt.redis.keys.lease(*job.lease_pair), stop_marker(job.dispatch_id))
    assert LeaseStore(rt.redis).abandon_delivery(DEAD, redelivered=job.dispatch_id) == (job.dispatch_id, "audio", True)
    assert _lease(rt, job) is None


def test_what_another_process_runs_is_never_touched(rt, tmp_path) -> None:
    job = _started_job(rt, tmp_path, holder=OTHER)
    assert LeaseStore(rt.redis).abandon_delivery(DEAD, redelivered=None) is None
    # The dead process's entry names the job, but the job is another copy's now: nothing is freed.
    rt.redis.client.set(rt.redis.keys.holding(DEAD), f"{job.dispatch_id}\n{rt.redis.keys.lease(*job.lease_pair)}")
    assert LeaseStore(rt.redis).abandon_delivery(DEAD, redelivered=None) is None
    assert _lease(rt, job) == job.dispatch_id
    assert rt.redis.client.get(rt.redis.keys.running(job.dispatch_id)) == OTHER


def test_a_node_started_again_lets_go_of_what_its_previous_run_still_held(rt, tmp_path) -> None:
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    running, ended, elsewhere = dispatched_jobs(rt, "b")
    leases = rt.ports.leases
    for job, holder in ((running, "audio@gpu-1#7"), (ended, "audio@gpu-1#8"), (elsewhere, "audio@gpu-2#7")):
        assert leases.start_delivery(job.lease_pair, job.dispatch_id, holder, 120)[:2] == (True, True)
    leases.release_lease(ended.lease_pair, ended.dispatch_id)
    leases.end_delivery(ended.dispatch_id)

    assert LeaseStore(rt.redis).abandon_node("audio@gpu-1") == [(running.dispatch_id, "audio", True)]
    assert [_lease(rt, j) for j in (running, ended, elsewhere)] == [None, None, elsewhere.dispatch_id]
    assert not rt.redis.client.exists(rt.redis.keys.holders("audio@gpu-1"))
    assert rt.redis.client.smembers(rt.redis.keys.holders("audio@gpu-2")) == {"audio@gpu-2#7"}
    assert LeaseStore(rt.redis).abandon_node("audio@gpu-1") == []  # a second start finds nothing


def test_reconcile_restores_no_queued_lease_for_a_job_delivered_since_it_looked_at_the_queue(rt, tmp_path) -> None:
    """Reconcile read the job as still queued; it was then delivered, and its pool process died at once (its
    running marker and lease let go). The restore found neither and took a queued lease, a day long, that
    nothing would end: the pair and its slot stood idle for a day."""
    job = _started_job(rt, tmp_path)  # delivered after reconcile looked
    assert LeaseStore(rt.redis).abandon_delivery(DEAD, redelivered=None) == (job.dispatch_id, "audio", True)
    restored = rt.ports.leases.restore_leases([(job.lease_pair, job.dispatch_id, job.fencing_token, 86_400.0)])
    assert restored == set() and _lease(rt, job) is None


def test_a_job_never_delivered_gets_its_queued_lease_back_after_redis_lost_it(rt, tmp_path) -> None:
    job = _dispatched_job(rt, tmp_path)
    rt.redis.client.delete(rt.redis.keys.lease(*job.lease_pair), rt.redis.keys.dispatch(job.dispatch_id))
    rt.ports.leases.restore_leases([(job.lease_pair, job.dispatch_id, job.fencing_token, 86_400.0)])
    assert _lease(rt, job) == job.dispatch_id


def test_a_job_let_go_of_is_never_taken_back_by_its_dying_process(rt, tmp_path) -> None:
    """Celery's hard time limit lets the job go (`GenerateRequest.on_timeout`), then kills its process a tenth of a
    second later; meanwhile the job's watcher found its lease gone and took it back as after a Redis loss. Old code:
    taken back, the pair and its slot waited a whole lease TTL for the tick (found by a plugin hunt: 33 s at a 30 s
    lease, 3 kills in 7)."""
    job = _started_job(rt, tmp_path)
    assert LeaseStore(rt.redis).abandon_delivery(DEAD, redelivered=None) == (job.dispatch_id, "audio", True)

    assert not rt.ports.leases.retake_lease(job.lease_pair, job.dispatch_id, DEAD, 120)
    assert _lease(rt, job) is None  # the tick takes the pair over


def test_a_job_whose_lease_redis_lost_takes_it_back(rt, tmp_path) -> None:
    job = _started_job(rt, tmp_path)
    rt.redis.client.delete(rt.redis.keys.lease(*job.lease_pair), rt.redis.keys.running(job.dispatch_id))
    assert rt.ports.leases.retake_lease(job.lease_pair, job.dispatch_id, DEAD, 120)
    assert _lease(rt, job) == job.dispatch_id


def test_a_kept_job_whose_process_died_is_failed_in_the_result_store(rt, tmp_path, monkeypatch) -> None:
    """A job kept to follow in another message's task (worker/chain.py) whose pool process died: Celery ends only the
    message's task. Old code: the kept job stayed PROGRESS in Flower and the result store for good, though the tick
    took its pair over and another job ran it (found by a Flower hunt, twice)."""
    from animastor_tasks.worker import app as worker_app
    from animastor_tasks.worker import lost

    monkeypatch.setattr(worker_app, "settings", rt.settings)
    job = _started_job(rt, tmp_path)
    app = rt.ports.publisher.app  # type: ignore[attr-defined]
    app.backend.store_result(job.dispatch_id, {"percent": 40.0}, "PROGRESS")

    lost.let_go("audio@gpu-1", 101, redelivered="the-message", message="the-message", app=app)

    result = app.AsyncResult(job.dispatch_id)
    assert result.state == "FAILURE" and type(result.result).__name__ == "WorkerLostError"
    assert _lease(rt, job) is None


def test_the_message_s_own_job_is_left_to_celery(rt, tmp_path, monkeypatch) -> None:
    from animastor_tasks.worker import app as worker_app
    from animastor_tasks.worker import lost

    monkeypatch.setattr(worker_app, "settings", rt.settings)
    job = _started_job(rt, tmp_path)
    app = rt.ports.publisher.app  # type: ignore[attr-defined]
    app.backend.store_result(job.dispatch_id, {"percent": 40.0}, "PROGRESS")

    lost.let_go("audio@gpu-1", 101, redelivered=None, message=job.dispatch_id, app=app)  # a hard time limit

    assert app.AsyncResult(job.dispatch_id).state == "PROGRESS"  # Celery fails it itself (TimeLimitExceeded)
    assert _lease(rt, job) is None
