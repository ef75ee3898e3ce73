"""The generate job run in-process on the real stores (the worker runs this same function)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate, takeover
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import Later, run_job
from animastor_tasks.flow.job import Job
from animastor_tasks.worker.wiring import Wiring

from .helpers import Pauses, advertise, make_book, states, use_settings
from .test_dispatch import CommandLog
from .test_http_generator import start_server  # noqa: F401  (fixture: the real reference server)


def with_stage(rt: Wiring, spec: StageSpec, tmp_path: Path, **settings: object) -> None:
    stages = tuple(spec if s.name == spec.name else s for s in rt.settings.stages)
    use_settings(
        rt,
        replace(
            rt.settings,
            registry=replace(rt.settings.registry, stages=stages),
            artifact_root=tmp_path / "artifacts",
            **settings,  # type: ignore[arg-type]
        ),
    )


def dispatched_jobs(rt: Wiring, book: str) -> list[Job]:
    with rt.db.transaction() as conn:
        rows = conn.execute(
            "SELECT chapter_id, scene_id, stage, dispatch_id, fencing_token FROM asset_states"
            " WHERE book_id = %s AND state = 'generating' ORDER BY chapter_id, scene_id, stage",
            (book,),
        ).fetchall()
    return [Job(book, c, s, st, d, t) for c, s, st, d, t in rows]


def drain(rt: Wiring, book: str) -> list[dict]:
    """Run every dispatched job, pass after pass, as GPU workers would (a pause a job asks for is not waited out)."""
    from animastor_tasks.flow import gate

    results: list[dict] = []
    for _ in range(50):
        jobs = dispatched_jobs(rt, book)
        if not jobs:
            rt.redis.client.delete(rt.redis.keys.deferrals(book, "capacity"))
            gate.gate_pass(rt.ports, book)
            jobs = dispatched_jobs(rt, book)
            if not jobs:
                return results
        results += [run_job(rt.ports, job, worker="test", later=Pauses()) for job in jobs]
    raise AssertionError("jobs never drained")


def test_http_generator_with_injected_5xx_ends_ready_or_failed(rt, tmp_path, start_server) -> None:  # noqa: F811
    url = start_server("--failure-rate", "0.2", "--fail-first", "2")  # some retries whatever the draw (0.8^20 = 1%)
    spec = replace(rt.settings.registry.get("audio"), generator="http", endpoint=f"{url}/v1/generate/audio")
    with_stage(rt, spec, tmp_path, retry_backoff_base=0.01, retry_backoff_max=0.05, generate_max_retries=3)
    rt.catalog.import_book(make_book("b", chapters=4, scenes=5))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    results = drain(rt, "b")
    outcomes = [r["outcome"] for r in results]
    retries = sum(r.get("attempts", 1) - 1 for r in results)
    print(f"http 20% 5xx: {len(results)} jobs, outcomes={dict(Counter(outcomes))}, retries={retries}")
    found = {p: s for p, s in states(rt, "b").items() if p[2] == "audio"}
    assert len(found) == 20 and set(found.values()) <= {"ready", "failed"}  # none lost
    assert retries > 0  # the injected failures were really retried
    with rt.db.transaction() as conn:
        rows = conn.execute("SELECT sha256, path, size_bytes FROM artifacts WHERE book_id = 'b'").fetchall()
    assert len(rows) == sum(1 for s in found.values() if s == "ready")
    for sha, path, size in rows:
        data = Path(path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha and len(data) == size and data[:4] == b"RIFF"
    status = {c.stage: c for c in rt.ports.commands.commands(book="b")}["audio"]
    assert status.status in {"completed", "failed"}


def test_a_backend_that_names_when_to_come_back_is_retried_then(rt, tmp_path, start_server) -> None:  # noqa: F811
    """A 503 with `Retry-After: 0.8` was retried at the worker's backoff (10 ms here): inside the window the server
    named, so a rate-limited backend failed its pairs in seconds. The hint now sets the wait, up to the cap."""
    url = start_server("--fail-first", "1", "--retry-after", "0.8")
    spec = replace(rt.settings.registry.get("audio"), generator="http", endpoint=f"{url}/v1/generate/audio")
    with_stage(rt, spec, tmp_path, retry_backoff_base=0.01, retry_backoff_max=5.0, generate_max_retries=3)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    started = time.monotonic()
    result = run_job(rt.ports, job, worker="test")
    assert result["outcome"] == "ready" and result["attempts"] == 2
    assert time.monotonic() - started >= 0.8


def one_running_job(rt: Wiring, tmp_path: Path, spec: StageSpec) -> tuple[Job, threading.Thread, dict[str, Any]]:
    """Book `b`'s one scene dispatched on `spec` and running in a thread: (its job, the thread, its result once
    it has returned)."""
    with_stage(rt, spec, tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, spec.queue)
    regenerate_flow.regenerate(rt.ports, "b", [spec.name])
    [job] = dispatched_jobs(rt, "b")
    outcome: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: outcome.update(run_job(rt.ports, job, worker="gpu@host#1")))
    worker.start()
    return job, worker, outcome


def test_cancel_stops_a_running_job_within_two_seconds(rt, tmp_path) -> None:
    slow = replace(rt.settings.registry.get("audio"), params={"steps": 40, "step_seconds": 0.25})
    _, worker, outcome = one_running_job(rt, tmp_path, slow)
    time.sleep(0.6)
    cancel_flow.cancel(rt.ports, "b")
    cancelled_at = time.monotonic()
    worker.join(timeout=5)
    stopped_after = time.monotonic() - cancelled_at
    print(f"stopped {stopped_after:.2f}s after cancel returned")
    assert outcome["outcome"] == "stopped" and stopped_after < 2.0
    assert states(rt, "b")[("ch1", "s1", "audio")] == "dirty"
    with rt.db.transaction() as conn:
        assert conn.execute("SELECT count(*) FROM artifacts").fetchone()[0] == 0


def test_a_job_that_lost_its_token_never_calls_the_generator(rt, tmp_path) -> None:
    with_stage(rt, replace(rt.settings.registry.get("audio"), params={"fail_rate": 1.0}), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    stale = replace(job, fencing_token=job.fencing_token - 1)
    result = run_job(rt.ports, stale, worker="test")
    assert result == {**result, "outcome": "fence_rejected", "reason": "stale_token"}
    with rt.db.transaction() as conn:
        started = conn.execute("SELECT count(*) FROM events WHERE kind = 'job.started'").fetchone()[0]
    assert started == 0  # fail_rate=1 would have failed the pair had the generator run


def test_cancelled_book_job_is_rejected_at_start(rt, tmp_path) -> None:
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    cancel_flow.cancel(rt.ports, "b")
    assert run_job(rt.ports, job, worker="late-worker")["outcome"] == "fence_rejected"


def test_a_duplicate_delivery_runs_once(rt, tmp_path) -> None:
    slow = replace(rt.settings.registry.get("audio"), params={"steps": 4, "step_seconds": 0.2})
    with_stage(rt, slow, tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    first: dict = {}
    thread = threading.Thread(target=lambda: first.update(run_job(rt.ports, job, worker="w1")))
    thread.start()
    time.sleep(0.2)
    second = run_job(rt.ports, job, worker="w2")
    thread.join(timeout=10)
    assert second["outcome"] == "duplicate_delivery" and first["outcome"] == "ready"
    with rt.db.transaction() as conn:
        assert conn.execute("SELECT count(*) FROM artifacts").fetchone()[0] == 1


def test_a_redelivery_after_its_worker_died_leaves_the_dead_jobs_lease_to_lapse(rt, tmp_path) -> None:
    """A worker killed mid-job (CUDA out of memory) has its message redelivered within seconds; the dead copy's
    running marker still stands, so the redelivery is a duplicate, as it should be. But it renewed the dead
    job's lease for a whole TTL first, so its pair was taken over that much later."""
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    assert rt.ports.leases.start_delivery(job.lease_pair, job.dispatch_id, "w1", 60)[:2] == (True, True)
    assert rt.ports.leases.renew_lease(job.lease_pair, job.dispatch_id, 1)  # its last renewal; then it died
    assert rt.ports.leases.start_delivery(job.lease_pair, job.dispatch_id, "w2", 60)[:2] == (True, False)
    assert 0 < rt.redis.client.pttl(rt.redis.keys.lease(*job.lease_pair)) <= 1000


def test_a_redelivery_of_a_job_that_already_ended_leaves_no_lease_behind(rt, tmp_path, monkeypatch) -> None:
    """A pool process that died after its job's commit, before the end of its delivery, has its message delivered
    again with the lease kept for it. That delivery took the lease for a whole TTL, was refused at its start (the
    pair was ready) and released nothing: a regenerate without force in that TTL read the lease as a job still
    running (`already_generating`) and deferred the pair for the idempotent window, with nothing running."""
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    with monkeypatch.context() as died:  # the process dies once the commit is in: its delivery never ends
        died.setattr("animastor_tasks.flow.generate._Delivered.end", lambda self: None)
        assert run_job(rt.ports, job, worker="w#1")["outcome"] == "ready"
    rt.ports.leases.abandon_delivery("w#1", job.dispatch_id)  # its worker lets it go; the broker redelivers
    assert run_job(rt.ports, job, worker="w#2")["outcome"] == "fence_rejected"
    assert rt.redis.client.pttl(rt.redis.keys.lease(*job.lease_pair)) == -2
    with rt.db.transaction() as conn:  # the scene edited: a regenerate without force has work to do
        conn.execute("UPDATE scenes SET text = 'new words', input_hashes = '{}'::jsonb WHERE book_id = 'b'")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=False)
    [again] = dispatched_jobs(rt, "b")
    assert again.fencing_token > job.fencing_token


def test_generator_errors_are_retried_then_failed_with_the_message(rt, tmp_path) -> None:
    failing = replace(rt.settings.registry.get("image"), params={"fail_rate": 1.0})
    with_stage(rt, failing, tmp_path, retry_backoff_base=0.01, generate_max_retries=2)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.image")
    regenerate_flow.regenerate(rt.ports, "b", ["image"])
    [job] = dispatched_jobs(rt, "b")
    result = run_job(rt.ports, job, worker="test")
    assert result["outcome"] == "failed" and result["attempts"] == 3
    with rt.db.transaction() as conn:
        error = conn.execute("SELECT error FROM asset_states WHERE state = 'failed'").fetchone()[0]
    assert error and "fail" in error.lower()
    [command] = rt.ports.commands.commands(book="b")
    assert command.status == "failed" and command.reason == "1 of 1 targets failed"


def test_an_unloadable_generator_fails_the_pair_once_with_the_reason(rt, tmp_path) -> None:
    with_stage(rt, replace(rt.settings.registry.get("audio"), generator="no-such-backend"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    result = run_job(rt.ports, job, worker="test")
    assert result["outcome"] == "failed" and result["attempts"] == 1
    assert "no-such-backend" in result["error"]
    assert states(rt, "b")[("ch1", "s1", "audio")] == "failed"  # not left generating to be re-dispatched


def run_with_a_loader_that_raises(rt: Wiring, tmp_path: Path, error: Exception, **settings: object) -> tuple[dict, Job]:
    """One audio job run whose generator cannot be loaded: `error` raised by the stage's loader."""

    class _Failing:
        def load(self, spec: StageSpec) -> Any:
            raise error

    with_stage(rt, rt.settings.registry.get("audio"), tmp_path, **settings)
    rt.ports = replace(rt.ports, generators=_Failing())
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    return run_job(rt.ports, job, worker="test"), job


def test_a_generator_whose_plugin_cannot_be_imported_fails_the_pair_once(rt, tmp_path) -> None:
    """A plugin's missing dependency raises ImportError as it loads: it escaped the job, which left its start open,
    so the pair was dispatched again and again until it failed as `worker_lost: 3 starts`, a reason that points
    at dead workers rather than at the plugin."""

    result, job = run_with_a_loader_that_raises(rt, tmp_path, ImportError("No module named 'torchaudio'"))
    assert result["outcome"] == "failed" and "torchaudio" in result["error"], result
    assert result["attempts"] == 1  # not retried: it would not import the next time either
    assert states(rt, "b")[job.pair] == "failed"
    # The worker is set up wrong, not the scene: it counts against the breaker (every pair failed, before).
    assert rt.redis.client.hget(rt.redis.keys.breaker("gpu.audio"), "failures") == "1"
    with rt.db.read() as conn:
        [(open_dispatch,)] = conn.execute("SELECT open_dispatch FROM job_starts WHERE book_id = 'b'").fetchall()
    assert open_dispatch is None


def test_a_generator_whose_factory_fails_is_a_backend_failure_that_feeds_the_breaker(rt, tmp_path) -> None:
    """A factory that fails for a passing reason (a GPU out of memory as the model loads) failed each pair at once
    as a plugin that cannot be loaded: a whole command in seconds, and the breaker heard nothing."""

    result, _ = run_with_a_loader_that_raises(
        rt, tmp_path, RuntimeError("CUDA out of memory"), generate_max_retries=1, retry_backoff_base=0.0
    )
    assert result["attempts"] == 2 and "CUDA out of memory" in result["error"], result
    assert rt.redis.client.hget(rt.redis.keys.breaker("gpu.audio"), "failures") == "1"


def test_a_generator_bug_fails_the_pair_instead_of_looping(rt, tmp_path) -> None:
    with_stage(rt, replace(rt.settings.registry.get("audio"), params={"steps": "many"}), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    result = run_job(rt.ports, job, worker="test")
    assert result["outcome"] == "failed" and "steps" in result["error"]
    assert states(rt, "b")[("ch1", "s1", "audio")] == "failed"


class _Kept(Later):
    """Keeps the bookkeeping steps a run gives, for the test to run."""

    def __init__(self) -> None:
        self.steps: list = []

    def __call__(self, step) -> None:
        self.steps.append(step)


def test_a_job_that_ends_ready_leaves_nothing_of_itself_in_redis_in_one_round_trip(rt, monkeypatch) -> None:
    """Its lease, its running marker and the deferrals of its pair (a pass that found it running deferred it)
    go in one round trip at its end: three before, on every job."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    job = dispatched_jobs(rt, "b")[0]
    rt.deferrals.defer("b", "idempotent", [job.pair], 600, time.time())
    kept = _Kept()
    assert run_job(rt.ports, job, worker="test", later=kept)["outcome"] == "ready"
    *before, end = kept.steps
    for step in before:
        step()
    keys, client = rt.redis.keys, rt.redis.client
    assert client.exists(keys.lease(*job.lease_pair), keys.running(job.dispatch_id)) == 2
    log = CommandLog(rt, monkeypatch)
    end()
    assert log.round_trips == 1
    assert client.exists(keys.lease(*job.lease_pair), keys.running(job.dispatch_id)) == 0
    assert client.zcard(keys.deferrals("b", "idempotent")) == 0


class ReimportDuringJob:
    """The real artifact store; the book is re-imported with new text just before the job stores its media."""

    def __init__(self, rt: Wiring, inner: Any) -> None:
        self.rt, self.inner = rt, inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, data: bytes, media_type: str) -> dict[str, Any]:
        self.rt.catalog.import_book(make_book("b", chapters=1, scenes=1, text="A new beginning"))
        stored: dict[str, Any] = self.inner.put(data, media_type)
        return stored


def test_a_scene_edited_while_its_job_runs_stays_stale_and_runs_again(rt, tmp_path) -> None:
    """The commit recorded the scene's hash at commit time: media made from the old text passed for made from
    the new one (the import had left the generating pair alone), and a regenerate settled it as done."""
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    ports = rt.ports
    rt.ports = replace(ports, artifacts=ReimportDuringJob(rt, ports.artifacts))
    assert run_job(rt.ports, job, worker="w")["outcome"] == "outdated"  # its media kept, made from the old text
    rt.ports = ports
    with rt.db.read() as conn:
        # Journalled as what it is: it was a `job.ready`, read as a scene ready by whoever counted the journal.
        kinds = conn.execute("SELECT kind FROM events WHERE dispatch_id = %s ORDER BY id", (job.dispatch_id,))
        assert [k for (k,) in kinds if k.startswith("job.")] == ["job.started", "job.outdated"]
        made_from, current = conn.execute(
            "SELECT a.input_hash, s.input_hashes ->> 'audio' FROM asset_states a JOIN scenes s"
            " USING (book_id, chapter_id, scene_id) WHERE a.book_id = 'b' AND a.stage = 'audio'"
        ).fetchone()
    assert made_from != current
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=False)
    assert [j.scene_id for j in dispatched_jobs(rt, "b")] == ["s1"]  # not settled as already completed


def test_a_job_refused_at_its_start_frees_its_slot_at_once(rt, tmp_path) -> None:
    """A job whose pair the gate denies at its start (here its layer was turned off while it waited in its queue)
    did no work, but kept its lease and its pair `generating`: the lane's slot idled until the lease lapsed and
    the tick took the pair over."""
    from animastor_tasks.flow import layers as layers_flow

    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    layers_flow.set_layers(rt.ports, "b", [], ["audio"])
    assert states(rt, "b")[job.pair] == "generating"  # a layer turned off releases only what waits
    rt.ports.deferrals.wait_for_lane("gpu.audio", "other", 0)  # the slot goes to a book waiting for the lane
    result = run_job(rt.ports, job, worker="test")
    assert result == {**result, "outcome": "fence_rejected", "reason": "layer_disabled"}
    assert rt.ports.leases.lease_holders([job.lease_pair]) == [None]
    assert states(rt, "b")[job.pair] != "generating"
    assert rt.ports.assets.lane_load(["audio"]).get("audio", 0) == 0
    # and the book's next pass, which releases the pair, is due now rather than at reconcile's turn
    assert rt.redis.client.zscore(rt.redis.keys.due(), "b") is not None


def test_a_lease_its_ended_job_left_behind_holds_a_regenerated_pair_only_until_it_lapses(rt, tmp_path) -> None:
    """A job ready, its lease's release lost to a Redis blip: the lease lives on for what was left of its TTL.
    A regenerate of the edited scene in that time found the pair `already_generating` and deferred it for the
    idempotent window (900 s), with nothing running and the slot free."""
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    assert run_job(rt.ports, job, worker="test")["outcome"] == "ready"
    lease = rt.redis.keys.lease(*job.lease_pair)
    rt.redis.client.set(lease, job.dispatch_id, px=1500)  # the release never reached Redis
    with rt.db.transaction() as conn:  # the scene edited: a regenerate without force has work to do
        conn.execute("UPDATE scenes SET text = 'new words', input_hashes = '{}'::jsonb WHERE book_id = 'b'")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=False)
    assert states(rt, "b")[("ch1", "s1", "audio")] == "pending"
    [(_, until)] = rt.redis.client.zrange(rt.redis.keys.deferrals("b", "idempotent"), 0, -1, withscores=True)
    assert until <= rt.ports.clock() + 2  # as long as the lease, not the idempotent window
    due = rt.redis.client.zscore(rt.redis.keys.due(), "b")
    assert due is not None and due <= until
    time.sleep(max(0.0, until - rt.ports.clock()) + 0.1)
    assert rt.redis.client.exists(lease) == 0
    gate.gate_pass(rt.ports, "b")
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"


def test_a_running_job_whose_lease_redis_lost_takes_it_back_and_finishes(rt, tmp_path) -> None:
    """Redis restarted without persistence mid-job: the tick found the started pair without a lease and took it
    over at once, and the job stopped at its next renewal (lease lost): every running job of the farm ran again
    from the start. Now the tick waits a lease TTL and the job takes its lease back: one run, committed."""
    slow = replace(rt.settings.registry.get("audio"), lease_ttl=3, params={"steps": 30, "step_seconds": 0.1})
    job, worker, outcome = one_running_job(rt, tmp_path, slow)
    time.sleep(0.5)
    rt.redis.client.flushdb()  # a restart without persistence: leases, markers, presence and all
    advertise(rt, "gpu.audio")  # the worker's next heartbeat
    lease = rt.redis.keys.lease(*job.lease_pair)
    taken_back = None
    while worker.is_alive():
        assert takeover.on_tick(rt.ports)["expired"] == 0
        if taken_back is None and rt.redis.client.get(lease) == job.dispatch_id:
            taken_back = time.monotonic()
        time.sleep(0.1)
    assert outcome["outcome"] == "ready", outcome
    assert taken_back is not None
    assert states(rt, "b")[("ch1", "s1", "audio")] == "ready"
    with rt.db.transaction() as conn:
        assert conn.execute("SELECT count(*) FROM events WHERE kind = 'job.started'").fetchone()[0] == 1


def test_a_started_job_that_does_not_take_its_lease_back_is_taken_over_after_a_lease_ttl(rt, tmp_path) -> None:
    """The wait after a Redis loss is for running jobs: a started pair whose job died meanwhile goes back once its
    stage's lease TTL has passed."""
    with_stage(rt, replace(rt.settings.registry.get("audio"), lease_ttl=2), tmp_path)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    with rt.db.transaction() as conn:  # its start recorded and never ended: its worker died with Redis
        conn.execute(
            "INSERT INTO job_starts (book_id, chapter_id, scene_id, stage, open_dispatch) VALUES (%s, %s, %s, %s, %s)",
            (*job.lease_pair, job.dispatch_id),
        )
    rt.redis.client.flushdb()
    advertise(rt, "gpu.audio")
    lost = time.monotonic()
    while takeover.on_tick(rt.ports)["expired"] == 0:
        assert time.monotonic() - lost < 4, "never taken over"
        time.sleep(0.1)
    assert time.monotonic() - lost >= 1.8
    assert states(rt, "b")[("ch1", "s1", "audio")] in ("pending", "generating")
