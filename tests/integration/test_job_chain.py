"""A finished job's process refills its own slot and runs that job itself (`worker/chain.py`).

Real Postgres, Redis and broker. The flow tests run the refill in-process; the worker tests run the
real tasks in a Celery worker thread (solo pool: one process, one slot) on the real broker.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import signals
from celery.contrib.testing.worker import start_worker

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.domain.vocabulary import JobOutcome
from animastor_tasks.errors import JobFailed, StoreUnavailable
from animastor_tasks.flow import refill
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.job import Job
from animastor_tasks.ports import Committed, GateRows
from animastor_tasks.worker import chain, flower_events, logs, wiring
from tests.support import wait_for

from .helpers import advertise, fake_artifact, make_book, states
from .test_elastic_share import lane, waiting

AUDIO = "gpu.audio"


def generating(rt: Any, book: str) -> list[str]:
    return sorted(s for (_, s, _), state in states(rt, book).items() if state == "generating")


def commit_ready(rt: Any, book: str, scene: str) -> tuple[str, Committed]:
    """The job of `scene` commits its output (what `run_job` does before it frees the slot): its dispatch id, and
    what the commit left its book (`free_slot`'s `left`)."""
    with rt.db.transaction() as conn:
        dispatch_id, token = conn.execute(
            "SELECT dispatch_id, fencing_token FROM asset_states WHERE book_id = %s AND scene_id = %s",
            (book, scene),
        ).fetchone()
    pair = ("ch1", scene, "audio")
    committed = rt.ports.jobs.commit_job(book, pair, token, dispatch_id, fake_artifact(scene), AUDIO)
    assert committed is not None
    return str(dispatch_id), committed


def free(rt: Any, book: str, ended: tuple[str, Committed]) -> None:
    """The slot of the job `commit_ready` ended is free, refilled in its own process."""
    refill.free_slot(rt.ports, book, AUDIO, ended[0], left=ended[1], here=True)


def test_a_refill_in_the_finished_jobs_process_fills_its_own_slot_and_leaves_the_others_to_theirs(rt) -> None:
    lane(rt, lane_limit=4, book_quota=4, window=4)
    rt.catalog.import_book(make_book("solo", chapters=1, scenes=10))
    regenerate_flow.regenerate(rt.ports, "solo", ["audio"])
    assert generating(rt, "solo") == ["s1", "s2", "s3", "s4"]
    # Two jobs end at once: two slots are free, and each finishing process refills one.
    first, second = commit_ready(rt, "solo", "s1"), commit_ready(rt, "solo", "s2")
    free(rt, "solo", first)
    assert generating(rt, "solo") == ["s3", "s4", "s5"]  # one slot: s2's process refills its own
    assert "solo" in waiting(rt)  # the pairs past it wait for the lane, as refused by it
    free(rt, "solo", second)
    assert generating(rt, "solo") == ["s3", "s4", "s5", "s6"]


def test_a_refill_whose_book_a_concurrent_claim_deferred_for_the_lane_still_fills_its_slot(rt) -> None:
    """Two jobs end at once: the second refill cleared the book's capacity deferrals before the first
    one's claim deferred the pairs past its one slot (`lane_full`); the second slot is still filled."""
    lane(rt, lane_limit=4, book_quota=4, window=4)
    rt.catalog.import_book(make_book("late", chapters=1, scenes=10))
    regenerate_flow.regenerate(rt.ports, "late", ["audio"])
    first, _ = commit_ready(rt, "late", "s1"), commit_ready(rt, "late", "s2")
    free(rt, "late", first)  # claims s5, defers s6... for the lane
    assert rt.redis.client.zscore(rt.redis.keys.deferrals("late", "capacity"), "ch1:s6:audio") is not None
    refill.refill(rt.ports, "late", None, slots_of=AUDIO)  # the second refill, past its bucket clear
    assert generating(rt, "late") == ["s3", "s4", "s5", "s6"]


def test_a_refill_that_claims_its_slot_s_pair_takes_its_hand_over_record_away_once(rt, monkeypatch) -> None:
    """Old code: the refill took the record away again after its claim had (one more Redis round trip on the way from
    a job's end to the next job's start). A refill that claims nothing of the lane still takes it away."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    rt.catalog.import_book(make_book("own", chapters=1, scenes=4))
    regenerate_flow.regenerate(rt.ports, "own", ["audio"])
    calls: list[str] = []
    taken_away = rt.ports.deferrals.hand_over_done
    monkeypatch.setattr(rt.ports.deferrals, "hand_over_done", lambda *a: calls.append(a[1]) or taken_away(*a))
    free(rt, "own", commit_ready(rt, "own", "s1"))
    assert generating(rt, "own") == ["s2", "s3"] and calls == ["own"]  # in the claim's own batch
    free(rt, "own", commit_ready(rt, "own", "s2"))
    free(rt, "own", commit_ready(rt, "own", "s3"))  # s4 runs: nothing is left to claim for this slot
    assert generating(rt, "own") == ["s4"] and calls == ["own", "own", "own"]
    assert not rt.redis.client.hexists(rt.redis.keys.lane_handed(AUDIO), "own")


class StaleCandidates:
    """The real asset store, except that every candidate read answers what the first one read."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.first = inner, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def gate_candidates(self, book: str, stages: Any, limit: int) -> GateRows | None:
        if self.first is None:
            self.first = self.inner.gate_candidates(book, stages, limit)
        return self.first


def test_a_refill_that_read_before_another_claimed_takes_the_next_pair_not_nothing(rt) -> None:
    """Two finishing processes read the same candidates; the second to claim skips the pair the first took."""
    lane(rt, lane_limit=4, book_quota=4, window=4)
    rt.catalog.import_book(make_book("race", chapters=1, scenes=10))
    regenerate_flow.regenerate(rt.ports, "race", ["audio"])
    first, second = commit_ready(rt, "race", "s1"), commit_ready(rt, "race", "s2")
    rt.ports = replace(rt.ports, assets=StaleCandidates(rt.ports.assets))
    free(rt, "race", first)
    free(rt, "race", second)  # its candidates still say s5 is pending
    assert generating(rt, "race") == ["s3", "s4", "s5", "s6"]


def test_a_job_kept_for_a_task_that_then_fails_is_published_after_all(rt) -> None:
    from animastor_tasks.worker.tasks import app

    lane(rt, lane_limit=1, book_quota=1, window=1)
    kept = Job("b", "ch1", "s2", "audio", "d2" * 16, 7)

    def run(ports: Any, job: Job, progress: Any, later: Any) -> dict[str, Any]:
        ports.publisher.publish_job("animastor.generate.audio", AUDIO, kept.dispatch_id, asdict(kept))
        raise RuntimeError("the task fails after its refill")

    task = app.tasks["animastor.generate.audio"]
    with pytest.raises(RuntimeError):
        chain.run_chain(task, rt.ports, AUDIO, Job("b", "ch1", "s1", "audio", "d1" * 16, 3), run)
    client = redis.Redis.from_url(rt.settings.broker_url)
    try:
        messages = [json.loads(raw) for raw in client.lrange(AUDIO, 0, -1)]
    finally:
        client.close()
    assert [m["headers"]["id"] for m in messages] == [kept.dispatch_id]


def test_a_kept_job_that_raised_before_its_start_check_is_published_after_all(rt) -> None:
    """A kept job whose delivery could not start (Redis did not answer `start_delivery`) was neither run nor
    published: its pair held its queued lease and slot, found only by reconcile's broker check."""
    from animastor_tasks.worker.tasks import app

    lane(rt, lane_limit=1, book_quota=1, window=1)
    kept = Job("b", "ch1", "s2", "audio", "d2" * 16, 7)

    def run(ports: Any, job: Job, progress: Any, later: Any) -> dict[str, Any]:
        if job == kept:
            raise StoreUnavailable("redis", rt.settings.redis_url, "connection reset")
        ports.publisher.publish_job("animastor.generate.audio", AUDIO, kept.dispatch_id, asdict(kept))
        return {"outcome": "ready"}

    task = app.tasks["animastor.generate.audio"]
    chain.run_chain(task, rt.ports, AUDIO, Job("b", "ch1", "s1", "audio", "d1" * 16, 3), run)
    assert _queued_ids(rt) == [kept.dispatch_id]


def test_a_kept_job_that_raised_after_its_start_check_is_not_published_again(rt) -> None:
    """Started, it is this delivery's as a delivered task's is (acked when it raises): never a second copy."""
    from animastor_tasks.worker.tasks import app

    lane(rt, lane_limit=1, book_quota=1, window=1)
    kept = Job("b", "ch1", "s2", "audio", "d2" * 16, 7)

    def run(ports: Any, job: Job, progress: Any, later: Any) -> dict[str, Any]:
        if job == kept:
            later.job_started()
            raise RuntimeError("a bug after the start")
        ports.publisher.publish_job("animastor.generate.audio", AUDIO, kept.dispatch_id, asdict(kept))
        return {"outcome": "ready"}

    task = app.tasks["animastor.generate.audio"]
    chain.run_chain(task, rt.ports, AUDIO, Job("b", "ch1", "s1", "audio", "d1" * 16, 3), run)
    assert _queued_ids(rt) == []


def _queued_ids(rt: Any) -> list[str]:
    client = redis.Redis.from_url(rt.settings.broker_url)
    try:
        return [json.loads(raw)["headers"]["id"] for raw in client.lrange(AUDIO, 0, -1)]
    finally:
        client.close()


def test_a_kept_job_is_announced_once_it_has_passed_its_start_check_not_before(rt, monkeypatch) -> None:
    """Flower's events of a kept job go out beside its run: its start waits for no broker round trip."""
    from animastor_tasks.worker.tasks import app

    lane(rt, lane_limit=1, book_quota=1, window=1)
    kept = Job("b", "ch1", "s2", "audio", "d2" * 16, 7)
    sent: list[tuple[str, str]] = []
    monkeypatch.setattr(flower_events, "announce", lambda task, kind, uuid, **_: sent.append((kind, uuid)))
    before_start: list[tuple[str, str]] = []

    def run(ports: Any, job: Job, progress: Any, later: Any) -> dict[str, Any]:
        if job == kept:
            before_start.extend(sent)
            later.job_started()
        else:
            ports.publisher.publish_job("animastor.generate.audio", AUDIO, kept.dispatch_id, asdict(kept))
        return {"outcome": "ready"}

    task = app.tasks["animastor.generate.audio"]
    chain.run_chain(task, rt.ports, AUDIO, Job("b", "ch1", "s1", "audio", "d1" * 16, 3), run)
    assert before_start == []
    of_kept = [(kind, d) for kind, d in sent if d == kept.dispatch_id]
    assert of_kept[:2] == [("task-received", kept.dispatch_id), ("task-started", kept.dispatch_id)]


def test_the_delivered_job_of_a_chain_is_succeeded_once_its_kept_successor_starts(rt, monkeypatch) -> None:
    """Flower and the result store said PROGRESS for the job the broker delivered until the whole chain ended (up to
    ANIMASTOR_JOB_CHAIN_SECONDS later), and for good when its worker was killed mid-chain (a hunt)."""
    from animastor_tasks.worker.tasks import app

    lane(rt, lane_limit=1, book_quota=1, window=1)
    first = Job("b", "ch1", "s1", "audio", "d1" * 16, 3)
    kept = Job("b", "ch1", "s2", "audio", "d2" * 16, 7)
    sent: list[tuple[str, str]] = []
    monkeypatch.setattr(flower_events, "announce", lambda task, kind, uuid, **_: sent.append((kind, uuid)))
    seen: dict[str, Any] = {}

    def run(ports: Any, job: Job, progress: Any, later: Any) -> dict[str, Any]:
        if job == kept:
            later.job_started()
            later.end()  # its predecessor's bookkeeping, held back until now, is done
            seen["state"], seen["events"] = app.AsyncResult(first.dispatch_id).state, list(sent)
        else:
            ports.publisher.publish_job("animastor.generate.audio", AUDIO, kept.dispatch_id, asdict(kept))
        return {"outcome": "ready", "scene": job.scene_id}

    task = app.tasks["animastor.generate.audio"]
    assert chain.run_chain(task, rt.ports, AUDIO, first, run) == {"outcome": "ready", "scene": "s1"}
    assert seen["state"] == "SUCCESS" and ("task-succeeded", first.dispatch_id) in seen["events"]
    assert app.AsyncResult(first.dispatch_id).result == {"outcome": "ready", "scene": "s1"}


def test_a_job_whose_scene_failed_is_a_failed_task_delivered_or_kept(rt, monkeypatch) -> None:
    """Flower and the result store showed a job that failed its scene for good SUCCESS (left out last session): its
    task now fails with `JobFailed`, expected (`throws`), after its verdict; a kept one is recorded failed too."""
    from animastor_tasks.worker.tasks import app

    lane(rt, lane_limit=1, book_quota=1, window=1)
    first = Job("b", "ch1", "s1", "audio", "d1" * 16, 3)
    kept = Job("b", "ch1", "s2", "audio", "d2" * 16, 7)
    sent: list[tuple[str, str]] = []
    monkeypatch.setattr(flower_events, "announce", lambda task, kind, uuid, **_: sent.append((kind, uuid)))

    def run(ports: Any, job: Job, progress: Any, later: Any) -> dict[str, Any]:
        if job == kept:
            later.job_started()
            return {"outcome": JobOutcome.FAILED, "error": "a scene no voice can read"}
        ports.publisher.publish_job("animastor.generate.audio", AUDIO, kept.dispatch_id, asdict(kept))
        return {"outcome": JobOutcome.READY}

    task = app.tasks["animastor.generate.audio"]
    assert chain.run_chain(task, rt.ports, AUDIO, first, run) == {"outcome": JobOutcome.READY}
    assert ("task-failed", kept.dispatch_id) in sent and ("task-succeeded", kept.dispatch_id) not in sent
    failed = app.AsyncResult(kept.dispatch_id)
    assert failed.state == "FAILURE" and isinstance(failed.result, JobFailed), failed.result
    assert str(failed.result) == "b/ch1/s2 audio failed: a scene no voice can read"

    alone = Job("b", "ch1", "s3", "audio", "d3" * 16, 9)
    with pytest.raises(JobFailed, match="b/ch1/s3 audio failed: a scene no voice can read"):
        chain.run_chain(task, rt.ports, AUDIO, alone, lambda *_: run(rt.ports, kept, None, _Started()))
    assert JobFailed in task.throws  # logged at INFO without a traceback: the job's own line is the ERROR


class _Started:
    def job_started(self) -> None:
        pass


def test_a_kept_jobs_log_lines_carry_its_own_ids(rt, monkeypatch) -> None:
    """Old code: a kept job's lines, its lease watcher's too, carried the first job's book, scene and dispatch id (the
    task's kwargs), so a search of the JSON logs by dispatch_id or book gave another job's lines."""
    import threading

    from animastor_tasks.worker.tasks import app

    lane(rt, lane_limit=1, book_quota=1, window=1)
    monkeypatch.setattr(logs._Lookup, "command_of", classmethod(lambda cls, fields: None))  # no command: ids only
    first = Job("b", "ch1", "s1", "audio", "d1" * 16, 3)
    kept = Job("b2", "ch2", "s2", "audio", "d2" * 16, 7)
    seen: dict[str, dict[str, str]] = {}

    def from_another_thread() -> dict[str, str]:  # as the job's lease watcher writes its lines
        found: list[dict[str, str]] = []
        watcher = threading.Thread(target=lambda: found.append(logs.current_context()))
        watcher.start()
        watcher.join()
        return found[0]

    def run(ports: Any, job: Job, progress: Any, later: Any) -> dict[str, Any]:
        if job == kept:
            later.job_started()
            seen["kept"], seen["kept's watcher"] = logs.current_context(), from_another_thread()
        else:
            ports.publisher.publish_job("animastor.generate.audio", AUDIO, kept.dispatch_id, asdict(kept))
            later(lambda: seen.setdefault("first's held step", logs.current_context()))  # run beside the kept job
        return {"outcome": "ready"}

    task = app.tasks["animastor.generate.audio"]
    task.push_request(id=first.dispatch_id, hostname="gpu-audio@test")
    logs.on_task_prerun(task_id=first.dispatch_id, task=task, kwargs=asdict(first))
    try:
        chain.run_chain(task, rt.ports, AUDIO, first, run)
        seen["first's task after"] = logs.current_context()
    finally:
        logs.on_task_postrun(task_id=first.dispatch_id)
        task.pop_request()

    ids = {k: (c.get("book"), c.get("chapter"), c.get("scene"), c.get("dispatch_id")) for k, c in seen.items()}
    assert ids == {
        "kept": ("b2", "ch2", "s2", kept.dispatch_id),
        "kept's watcher": ("b2", "ch2", "s2", kept.dispatch_id),
        "first's held step": ("b", "ch1", "s1", first.dispatch_id),
        "first's task after": ("b", "ch1", "s1", first.dispatch_id),
    }


def test_a_kept_jobs_events_and_progress_reach_flower_under_the_workers_name(rt, monkeypatch) -> None:
    """What Flower hears of a kept job, off the broker's event exchange: received, started, progress, succeeded."""
    import threading

    from animastor_tasks.worker.tasks import app

    lane(rt, lane_limit=1, book_quota=1, window=1)
    monkeypatch.setattr(flower_events.Events, "on", True)
    monkeypatch.setattr(flower_events, "PROGRESS_EVERY", 0.0)  # its one report is due at once
    kept = Job("b", "ch1", "s2", "audio", "d2" * 16, 7)
    heard: list[dict[str, Any]] = []
    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": heard.append})
        listening = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": 20}, daemon=True)
        listening.start()
        task = app.tasks["animastor.generate.audio"]

        def listening_now() -> bool:  # the event exchange keeps nothing: probe until the receiver hears
            flower_events.send_event(task, "animastor-probe", uuid="probe")
            return any(e["type"] == "animastor-probe" for e in heard)

        def run(ports: Any, job: Job, progress: Any, later: Any) -> dict[str, Any]:
            if job == kept:
                later.job_started()
                # A report due while its start is still being announced is left out (`chain._once_announced`).
                wait_for(lambda: not later.holding(), 10, "its start announced")
                progress(1.0)
            else:
                ports.publisher.publish_job("animastor.generate.audio", AUDIO, kept.dispatch_id, asdict(kept))
            return {"outcome": JobOutcome.READY}  # as `run_job` answers

        def kinds() -> list[str]:
            return [e["type"] for e in heard if e.get("uuid") == kept.dispatch_id]

        task.push_request(hostname="gpu-audio@test")
        try:
            wait_for(listening_now, 10, "the event receiver listening")
            chain.run_chain(task, rt.ports, AUDIO, Job("b", "ch1", "s1", "audio", "d1" * 16, 3), run)
            wait_for(lambda: "task-succeeded" in kinds(), 10, "the kept job's events")
        finally:
            task.pop_request()
            receiver.should_stop = True  # the receiver's thread ends before its connection closes, pass or fail
            listening.join(timeout=10)
        assert not listening.is_alive()
    # Its progress goes out from the job's own thread, after the announcements of its start.
    assert [k for k in kinds() if k != "task-progress"] == ["task-received", "task-started", "task-succeeded"]
    assert kinds().index("task-progress") > kinds().index("task-started"), kinds()
    progress = next(e for e in heard if e["type"] == "task-progress")
    assert (progress["hostname"], progress["percent"], progress["scene_id"]) == ("gpu-audio@test", 100.0, "s2")
    # Each under the worker's name: sent from the thread the announcements are held back in, they were sent
    # under `unknown` (Celery keeps a task's request per thread), a worker Flower listed that never existed.
    assert {e["hostname"] for e in heard if e.get("uuid") == kept.dispatch_id} == {"gpu-audio@test"}
    # Its result as a delivered job's reads (old: "{'outcome': <JobOutcome.READY: 'ready'>}").
    [succeeded] = [e for e in heard if e["type"] == "task-succeeded" and e.get("uuid") == kept.dispatch_id]
    assert succeeded["result"] == "{'outcome': 'ready'}"


# ---------------------------------------------------------------------------------------------------------------------
# A real worker (one process, solo pool)


@pytest.fixture
def one_process(rt: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """A factory: a worker thread consuming the control and audio queues, with the given lane and chain budget."""
    from animastor_tasks.worker.tasks import app

    monkeypatch.setenv("ANIMASTOR_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    workers: list[Any] = []

    def start(lane_limit: int, step_seconds: float, chain_seconds: float) -> Any:
        stage = {
            "queue": AUDIO,
            "input": "text",
            "media_type": "audio/wav",
            "lane_limit": lane_limit,
            "book_quota": lane_limit,
            "window": lane_limit,
            "params": {"steps": 1, "step_seconds": step_seconds},
        }
        monkeypatch.setenv("ANIMASTOR_STAGES", json.dumps({"audio": stage}))
        monkeypatch.setenv("ANIMASTOR_JOB_CHAIN_SECONDS", str(chain_seconds))
        wiring.reset()
        runtime = wiring.current()
        advertise(runtime, AUDIO, CONTROL_QUEUE)
        worker = start_worker(app, perform_ping_check=False, queues=[CONTROL_QUEUE, AUDIO], shutdown_timeout=30)
        worker.__enter__()
        workers.append(worker)
        return runtime

    try:
        yield start
    finally:
        for worker in workers:
            worker.__exit__(None, None, None)
        wiring.reset()


@pytest.fixture
def task_runs() -> Iterator[list[str]]:
    """The ids of the GPU tasks Celery ran (one per message delivered)."""
    ran: list[str] = []

    def count(sender: Any = None, task_id: str = "", **_: Any) -> None:
        if getattr(sender, "name", "").startswith("animastor.generate."):
            ran.append(task_id)

    signals.task_prerun.connect(count, weak=False)
    try:
        yield ran
    finally:
        signals.task_prerun.disconnect(count)


def run_book(runtime: Any, book: str, scenes: int) -> list[tuple[str, str]]:
    """Regenerate `book`'s audio through the worker; (scene, dispatch id) of each job in the order they started."""
    from animastor_tasks.worker.tasks import regenerate

    runtime.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate.apply_async(kwargs={"book_id": book, "stages": ["audio"]})

    def done() -> bool:
        rows = runtime.ports.commands.commands(book=book)
        return bool(rows) and all(r.status == "completed" for r in rows)

    wait_for(done, 60, f"the audio command of {book} completed")
    with runtime.db.transaction() as conn:
        rows = conn.execute(
            "SELECT scene_id, dispatch_id FROM events WHERE kind = 'job.started' AND book_id = %s ORDER BY at, id",
            (book,),
        ).fetchall()
    return [(str(s), str(d)) for s, d in rows]


def test_a_process_whose_job_ends_runs_its_slots_next_job_itself_each_under_its_own_id(one_process, task_runs) -> None:
    from animastor_tasks.worker.tasks import app

    runtime = one_process(lane_limit=1, step_seconds=0, chain_seconds=30)
    started = run_book(runtime, "chained", 3)
    assert [s for s, _ in started] == ["s1", "s2", "s3"]
    assert task_runs == [started[0][1]]  # one message delivered: the refills kept the next two here

    def kept() -> int:  # counted after each kept job ran, so it may land after the command completed
        return int(runtime.redis.client.hget(runtime.redis.keys.metrics(), "job:kept:audio") or 0)

    wait_for(lambda: kept() >= 2, 10, "2 kept jobs counted")
    assert kept() == 2
    for _, dispatch_id in started:  # Flower and clients find each job's result under its own id
        result = app.AsyncResult(dispatch_id)
        wait_for(lambda r=result: r.ready(), 10, f"result of {dispatch_id}")
        assert result.result["outcome"] == "ready", result.result


def test_without_a_chain_budget_every_job_is_a_delivered_task(one_process, task_runs) -> None:
    runtime = one_process(lane_limit=1, step_seconds=0, chain_seconds=0)
    started = run_book(runtime, "unchained", 3)
    assert task_runs == [d for _, d in started]
    assert runtime.redis.client.hget(runtime.redis.keys.metrics(), "job:kept:audio") is None


def test_a_kept_job_never_overtakes_one_waiting_in_the_queue(one_process, task_runs) -> None:
    """Two slots, one process: a job always waits in the queue, so each refill publishes behind it."""
    runtime = one_process(lane_limit=2, step_seconds=0.1, chain_seconds=30)
    started = run_book(runtime, "queued", 5)
    assert [s for s, _ in started] == ["s1", "s2", "s3", "s4", "s5"]  # the order they were dispatched in
    assert len(task_runs) >= 4, task_runs  # at most the last job, claimed with the queue empty, ran kept
