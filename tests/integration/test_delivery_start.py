"""A delivered job's start while Redis does not answer: tried again in place, and given back to the broker when
Redis stays away, never acked with its pair left holding a slot (real Postgres and Redis; the first answers of
the lease store are lost or refused as in a Redis blip)."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import Reject

from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow.generate import run_job
from animastor_tasks.worker import tasks  # noqa: F401 (registers the GPU tasks)
from animastor_tasks.worker.app import app
from animastor_tasks.worker.wiring import Wiring

from .test_generate import dispatched_jobs
from .test_job_troubles import _one_scene


def _starts(rt: Wiring) -> int:
    with rt.db.transaction() as conn:
        return int(conn.execute("SELECT count(*) FROM job_starts").fetchone()[0])


def _blip(rt: Wiring, monkeypatch: pytest.MonkeyPatch, *, answered: bool, times: int) -> list[int]:
    """The lease store's first `times` starts fail as in a Redis blip: `answered`, Redis ran the start and its reply
    was lost; otherwise it refused the connection. The calls made."""
    real, calls = rt.ports.leases.start_delivery, [0]

    def flaky(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] <= times:
            if answered:
                real(*args)
            raise StoreUnavailable("redis", rt.settings.redis_url, "Connection reset by peer")
        return real(*args)

    monkeypatch.setattr(rt.ports.leases, "start_delivery", flaky)
    return calls


def test_a_start_whose_answer_was_lost_is_tried_again_and_the_job_runs(rt, tmp_path, monkeypatch) -> None:
    """The start raised at once: Celery acked the task, its message gone, and the pair held a slot under its lease
    until reconcile or the tick took it over (120 s for one whose start Redis had run). Tried again by the same
    process, the start Redis ran already is its own."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    calls = _blip(rt, monkeypatch, answered=True, times=1)
    result = run_job(rt.ports, job, worker="test@local:1")
    assert result["outcome"] == "ready", result
    assert calls == [2] and _starts(rt) == 1


def test_a_start_redis_never_answers_gives_the_message_back_to_the_broker(rt, tmp_path, monkeypatch) -> None:
    """On RabbitMQ the worker kept receiving during a Redis outage: each job failed its start in milliseconds and was
    acked, and the queue's whole backlog was dropped, each pair waiting for reconcile. Now the message is rejected
    back to its queue, untouched, and its next delivery runs the job once Redis answers."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    calls = _blip(rt, monkeypatch, answered=False, times=100)
    task = app.tasks[rt.settings.registry.get("audio").task_name]
    fields = {k: getattr(job, k) for k in ("book_id", "chapter_id", "scene_id", "stage", "dispatch_id")}
    with pytest.raises(Reject) as info:
        task.run(**fields, fencing_token=job.fencing_token)
    assert info.value.requeue and calls[0] > 1
    assert _starts(rt) == 0 and rt.redis.client.exists(rt.redis.keys.queued(job.dispatch_id))
    monkeypatch.undo()  # Redis answers again: the message delivered again runs
    assert run_job(rt.ports, job, worker="test@local:2")["outcome"] == "ready"
