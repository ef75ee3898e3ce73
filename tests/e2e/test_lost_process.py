"""A GPU worker's pool process killed mid-job (the OOM killer, a CUDA fault), its main process alive: the job
runs again at once, not once its lease lapses. The stage keeps the default `lease_ttl` of 120 s, so a pair
that waited for its lease would still be `generating` long after these tests' bounds.

- the job its message names: the redelivery (`reject_on_worker_lost`) runs it again, not refused as a
  duplicate while the dead process's running marker stands;
- a job kept to follow in the same task (no message of its own): its lease is given up and the tick takes the
  pair over.
"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest

from tests.integration.helpers import make_book
from tests.support import wait_for
from tests.support.cluster import Proc, pool_children
from tests.support.stack import Stack

from .harness import audio_stage, image_stage, stage_table

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SLOW = {"steps": 10, "step_seconds": 0.2}  # 2 s per job: a kill lands well inside it
LEASE_TTL = 120  # the default: what a pair would wait for without the main process letting its job go
BOUND = 15.0  # seconds from the kill to the pair ready again: a tick (1 s here) and a 2 s job, with room


def _stack(make_stack: Any, params: dict[str, Any] = SLOW, **audio: Any) -> tuple[Stack, Proc]:
    stack = make_stack(
        stages=stage_table(audio=audio_stage(params=params, lease_ttl=LEASE_TTL, **audio), image=image_stage()),
        presence_ttl_seconds=10,  # a pool process's death must not read as the worker gone
    )
    cluster = stack.cluster
    gpu = cluster.gpu("audio", wait=False)
    cluster.wait_ready(cluster.control(wait=False), gpu, cluster.beat(wait=False))
    return stack, gpu


def _started(stack: Stack, book: str, scene: str) -> list[dict[str, Any]]:
    return [e for e in stack.events("job.started", book) if e["scene_id"] == scene]


def _kill_pool_child(gpu: Proc) -> int:
    [child] = wait_for(lambda: pool_children(gpu.pid) or None, 10, interval=0.02, what="the pool child")
    os.kill(child, signal.SIGKILL)
    return child


def _state(stack: Stack, book: str, scene: str) -> str:
    [(state,)] = stack.query(
        "SELECT state FROM asset_states WHERE book_id = %s AND scene_id = %s AND stage = 'audio'", (book, scene)
    )
    return str(state)


def test_a_job_whose_pool_process_dies_is_redelivered_and_runs_again_at_once(make_stack, figure) -> None:
    stack, gpu = _stack(make_stack)
    book = make_book("lost-process", chapters=1, scenes=1)
    stack.rt.catalog.import_book(book)

    stack.client.regenerate(book.book_id, ["audio"], wait=False)
    wait_for(lambda: _started(stack, book.book_id, "s1") or None, 20, what="the job started")
    time.sleep(0.5)  # inside its run
    killed = _kill_pool_child(gpu)
    at = time.monotonic()
    wait_for(lambda: _state(stack, book.book_id, "s1") == "ready", BOUND, what="the pair ready again")
    took = time.monotonic() - at

    starts = _started(stack, book.book_id, "s1")
    assert len(starts) == 2, starts
    assert starts[0]["dispatch_id"] == starts[1]["dispatch_id"], "the redelivered message ran, not a new dispatch"
    assert [s["detail"]["lost_starts"] for s in starts] == [0, 1]
    assert not stack.cluster.logs_mentioning("duplicate delivery")
    assert gpu.log().count("its redelivery runs it again") == 1, gpu.tail()
    assert gpu.alive()
    assert stack.rt.redis.client.hget(stack.rt.redis.keys.metrics(), "job:process_lost:audio") == "1"
    figure(f"pool process {killed} SIGKILLed mid-job: ready again {took:.1f}s later (lease_ttl {LEASE_TTL} s)")


def test_a_kept_job_whose_pool_process_dies_is_taken_over_by_the_next_tick(make_stack, figure) -> None:
    # One slot: the first job's refill claims the second scene and, nothing waiting in the queue, the same
    # process runs it in the same task.
    stack, gpu = _stack(make_stack, lane_limit=1, book_quota=1)
    book = make_book("lost-kept", chapters=1, scenes=2)
    stack.rt.catalog.import_book(book)

    stack.client.regenerate(book.book_id, ["audio"], wait=False)
    wait_for(lambda: _state(stack, book.book_id, "s1") == "ready" or None, 20, what="the first job ready")
    [second] = wait_for(lambda: _started(stack, book.book_id, "s2") or None, 10, what="the kept job started")
    time.sleep(0.5)
    killed = _kill_pool_child(gpu)
    at = time.monotonic()
    wait_for(lambda: _state(stack, book.book_id, "s2") == "ready", BOUND, what="the kept pair ready again")
    took = time.monotonic() - at

    starts = _started(stack, book.book_id, "s2")
    assert len(starts) == 2 and starts[1]["dispatch_id"] != second["dispatch_id"], starts
    assert starts[1]["detail"]["lost_starts"] == 1
    assert gpu.log().count(f"running dispatch {second['dispatch_id']}; the tick takes its pair over") == 1, gpu.tail()
    figure(f"pool process {killed} SIGKILLed in a kept job: pair taken over and ready {took:.1f}s later")


def test_a_worker_killed_whole_and_started_again_lets_go_of_its_previous_runs_job(make_stack, figure) -> None:
    stack, gpu = _stack(make_stack, lane_limit=1, book_quota=1)  # one slot: the dead job's lease holds it
    book = make_book("lost-worker", chapters=1, scenes=1)
    stack.rt.catalog.import_book(book)
    node = gpu.hostname
    assert node

    stack.client.regenerate(book.book_id, ["audio"], wait=False)
    [first] = wait_for(lambda: _started(stack, book.book_id, "s1") or None, 20, what="the job started")
    time.sleep(0.5)
    stack.cluster.kill(gpu)  # the whole process group: nothing of that run is left to tell
    at = time.monotonic()
    # The same node name, as a restarted container has (the harness's readiness check knows its own names only).
    again = stack.cluster.gpu("audio", args=["-n", node], wait=False)
    wait_for(lambda: _state(stack, book.book_id, "s1") == "ready", BOUND, what="the pair ready again")
    took = time.monotonic() - at

    starts = _started(stack, book.book_id, "s1")
    assert len(starts) == 2 and starts[1]["dispatch_id"] != first["dispatch_id"], starts
    [let_go_line] = [line for line in again.log().splitlines() if f"dispatch {first['dispatch_id']} of its" in line]
    # As every other line of the worker: when, and how bad. *Why:* logged before Celery set its logging up, the line
    # came out bare, with neither.
    assert re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}: WARNING/", let_go_line), let_go_line
    # Its result (and Flower's view, from the same step) kept the STARTED its killed run left, for good.
    let_go = stack.client.app.AsyncResult(first["dispatch_id"])
    assert let_go.state == "FAILURE" and "let the job go" in str(let_go.result), (let_go.state, let_go.result)
    figure(f"GPU worker SIGKILLed mid-job and started again as {node}: pair ready {took:.1f}s after the kill")


def test_a_job_its_worker_was_told_to_stop_under_counts_no_lost_start(make_stack, figure) -> None:
    """A rollout: the worker was sent SIGTERM (a warm shutdown) and killed when its grace ran out, mid-job. The
    start it left open counted as worker-lost, as one an OOM kill leaves: a scene chased from worker to worker by a
    rolling restart failed `worker_lost` after `ANIMASTOR_WORKER_LOST_LIMIT` starts (1 here: at its first)."""
    stack = make_stack(
        stages=stage_table(audio=audio_stage(params=SLOW, lease_ttl=LEASE_TTL), image=image_stage()),
        presence_ttl_seconds=10,
        worker_lost_limit=1,
    )
    cluster = stack.cluster
    gpu = cluster.gpu("audio", wait=False)
    cluster.wait_ready(cluster.control(wait=False), gpu, cluster.beat(wait=False))
    book = make_book("rollout", chapters=1, scenes=1)
    stack.rt.catalog.import_book(book)
    node = gpu.hostname
    assert node

    stack.client.regenerate(book.book_id, ["audio"], wait=False)
    wait_for(lambda: _started(stack, book.book_id, "s1") or None, 20, what="the job started")
    cluster.send_signal(gpu, signal.SIGTERM, group=False)  # the deployment asks it to stop...
    noted = "SELECT 1 FROM job_starts WHERE book_id = %s AND shutdown_at IS NOT NULL"
    wait_for(lambda: stack.query(noted, (book.book_id,)), 10, interval=0.05, what="the start noted")
    cluster.kill(gpu)  # ...and its grace runs out, mid-job
    at = time.monotonic()
    cluster.gpu("audio", args=["-n", node], wait=False)  # the rollout's new pod, under the same name
    wait_for(lambda: _state(stack, book.book_id, "s1") in ("ready", "failed"), BOUND, what="the pair done")
    starts = _started(stack, book.book_id, "s1")
    assert _state(stack, book.book_id, "s1") == "ready", starts
    assert len(starts) == 2 and starts[1]["detail"]["lost_starts"] == 0, starts
    took = time.monotonic() - at
    figure(f"GPU worker told to stop, then killed mid-job: no lost start counted, pair ready {took:.1f}s after")


@pytest.mark.parametrize(
    ("sig", "env"), [(signal.SIGQUIT, {}), (signal.SIGTERM, {"REMAP_SIGTERM": "SIGQUIT"})], ids=["SIGQUIT", "remapped"]
)
def test_a_job_a_cold_shutdown_kills_counts_no_lost_start(
    make_stack: Any, figure: Any, sig: int, env: dict[str, str]
) -> None:
    """A cold shutdown (SIGQUIT, or SIGTERM under `REMAP_SIGTERM=SIGQUIT`) kills the running job
    itself. Celery kills it in its signal handler, before it sends `worker_shutting_down`: the note came after the
    kill, and the job's next start counted a lost one (at a limit of 1: `worker_lost: 1 starts`, the pair failed)."""
    stack = make_stack(
        stages=stage_table(audio=audio_stage(params=SLOW, lease_ttl=LEASE_TTL), image=image_stage()),
        presence_ttl_seconds=10,
        worker_lost_limit=1,
    )
    cluster = stack.cluster
    gpu = cluster.gpu("audio", env=env, wait=False)
    cluster.wait_ready(cluster.control(wait=False), gpu, cluster.beat(wait=False))
    book = make_book("cold", chapters=1, scenes=1)
    stack.rt.catalog.import_book(book)

    stack.client.regenerate(book.book_id, ["audio"], wait=False)
    wait_for(lambda: _started(stack, book.book_id, "s1") or None, 20, what="the job started")
    time.sleep(0.5)  # inside its run
    cluster.send_signal(gpu, sig, group=False)  # the operator's cold shutdown
    at = time.monotonic()
    gpu.popen.wait(timeout=30)
    assert "Cold shutdown" in gpu.log(), gpu.tail()  # Celery's own, after ours
    cluster.gpu("audio", wait=False)  # its successor
    wait_for(lambda: _state(stack, book.book_id, "s1") in ("ready", "failed"), BOUND, what="the pair done")
    starts = _started(stack, book.book_id, "s1")
    assert _state(stack, book.book_id, "s1") == "ready", starts
    assert len(starts) == 2 and starts[1]["detail"]["lost_starts"] == 0, starts
    took = time.monotonic() - at
    figure(f"GPU worker cold-shut-down mid-job: no lost start counted, pair ready {took:.1f}s after")


def test_a_worker_shut_down_remotely_keeps_no_job_and_notes_its_running_one(make_stack: Any, figure: Any) -> None:
    """Flower's Shut Down (`celery control shutdown`) is a warm shutdown Celery starts from its control command, with
    no signal and no `worker_shutting_down`: the job ending next kept its slot's next job and ran it in the same task
    (the drain one whole job longer, the host freed that much later), and its start was never noted."""
    stack, gpu = _stack(make_stack, lane_limit=1, book_quota=1)  # one slot: s1's end claims s2 for this process
    book = make_book("remote-stop", chapters=1, scenes=2)
    stack.rt.catalog.import_book(book)
    node = gpu.hostname
    assert node

    stack.client.regenerate(book.book_id, ["audio"], wait=False)
    wait_for(lambda: _started(stack, book.book_id, "s1") or None, 20, what="the job started")
    stack.client.app.control.shutdown(destination=[node])
    noted = "SELECT 1 FROM job_starts WHERE book_id = %s AND scene_id = 's1' AND shutdown_at IS NOT NULL"
    wait_for(lambda: stack.query(noted, (book.book_id,)), 10, interval=0.05, what="the start noted")
    gpu.popen.wait(timeout=30)  # drained: s1 finishes, and no job after it
    assert _state(stack, book.book_id, "s1") == "ready"
    assert not _started(stack, book.book_id, "s2"), gpu.tail()  # published for another worker, not run here
    successor = stack.cluster.gpu("audio", wait=False)
    wait_for(lambda: _state(stack, book.book_id, "s2") == "ready", BOUND, what="s2 ready on the successor")
    [second] = _started(stack, book.book_id, "s2")
    assert f"dispatch={second['dispatch_id']} token=1 started on" in successor.log(), successor.tail()
    figure("GPU worker shut down remotely mid-job: its start noted, its slot's next job left to the broker")


def test_a_second_live_worker_under_the_same_name_leaves_the_first_ones_job_alone(make_stack, figure) -> None:
    stack, gpu = _stack(make_stack, params={"steps": 12, "step_seconds": 1.0})  # still running when the twin decides
    book = make_book("same-name", chapters=1, scenes=1)
    stack.rt.catalog.import_book(book)
    stack.client.regenerate(book.book_id, ["audio"], wait=False)
    [first] = wait_for(lambda: _started(stack, book.book_id, "s1") or None, 20, what="the job started")
    twin = stack.cluster.gpu("audio", args=["-n", gpu.hostname], wait=False)  # a misconfigured second worker
    wait_for(lambda: "another worker runs as" in twin.log() or None, 20, what="the twin to see the live name")
    assert _state(stack, book.book_id, "s1") == "generating"  # the twin decided while the job ran
    wait_for(lambda: _state(stack, book.book_id, "s1") == "ready", 30, what="the first worker's job ready")
    assert _started(stack, book.book_id, "s1") == [first]  # never taken over, never run again
    assert "of its previous run let go" not in twin.log()
    figure("a second worker started under a live worker's name: its job left alone, ready after one start")


def test_a_worker_that_never_comes_back_has_its_job_taken_over_by_another(make_stack, figure) -> None:
    """A lost host, or a pod a deployment replaced under a new name: nothing of it comes back to let go of its job.
    Old code: its lease held the lane's one slot for `lease_ttl` (120 s), the other worker idle."""
    stack = make_stack(
        stages=stage_table(
            audio=audio_stage(params=SLOW, lease_ttl=LEASE_TTL, lane_limit=1, book_quota=1), image=image_stage()
        ),
        silent_worker_seconds=6,  # the least the e2e stacks' presence TTL of 3 s allows (the default is 30)
    )
    cluster = stack.cluster
    workers = [cluster.gpu("audio", wait=False), cluster.gpu("audio", wait=False)]  # two hosts, each its own name
    cluster.wait_ready(cluster.control(wait=False), *workers, cluster.beat(wait=False))
    book = make_book("lost-host", chapters=1, scenes=1)
    stack.rt.catalog.import_book(book)

    stack.client.regenerate(book.book_id, ["audio"], wait=False)
    [first] = wait_for(lambda: _started(stack, book.book_id, "s1") or None, 20, what="the job started")
    line = f"dispatch={first['dispatch_id']} token=1 started on"  # logged just after the journal's start commits
    [lost] = wait_for(lambda: [w for w in workers if line in w.log()] or None, 10, what="the start's log line")
    [other] = [w for w in workers if w is not lost]
    time.sleep(0.5)
    cluster.kill(lost)  # the whole process group, never started again
    at = time.monotonic()
    # 6 s of silence, a tick, a 2 s job: well inside 25 s, and the lease (120 s) far outside it.
    wait_for(lambda: _state(stack, book.book_id, "s1") == "ready", 25, what="the pair ready on the other worker")
    took = time.monotonic() - at

    starts = _started(stack, book.book_id, "s1")
    assert len(starts) == 2 and starts[1]["dispatch_id"] != first["dispatch_id"], starts
    assert f"dispatch={starts[1]['dispatch_id']} token=2 started on {other.hostname}" in other.log(), other.tail()
    assert len(cluster.logs_mentioning(f"worker {lost.hostname} stopped beating")) == 1
    assert stack.rt.redis.client.hget(stack.rt.redis.keys.metrics(), "job:node_lost:audio") == "1"
    figure(f"GPU worker {lost.hostname} SIGKILLed mid-job, never back: ready on another worker {took:.1f}s later")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_job_an_operator_terminates_frees_its_slot_within_a_tick(make_stack, figure, sig: str) -> None:
    """`revoke --terminate` (Flower's Terminate) signals the pool process running the job, and Celery reports it
    as terminated, not as a lost process. A SIGTERM lets the job's own clean-up run; after a SIGKILL its lease and
    running marker stood, and the pair and its slot waited out the lease (120 s) before the tick took the pair
    over. Its command is still active: the pair runs again."""
    stack, gpu = _stack(make_stack)
    book = make_book("terminated", chapters=1, scenes=1)
    stack.rt.catalog.import_book(book)

    stack.client.regenerate(book.book_id, ["audio"], wait=False)
    [first] = wait_for(lambda: _started(stack, book.book_id, "s1") or None, 20, what="the job started")
    time.sleep(0.5)
    stack.client.app.control.revoke(first["dispatch_id"], terminate=True, signal=sig)
    at = time.monotonic()
    wait_for(lambda: len(_started(stack, book.book_id, "s1")) == 2 or None, BOUND, what="the pair dispatched again")
    wait_for(lambda: _state(stack, book.book_id, "s1") == "ready", BOUND, what="the pair ready again")
    took = time.monotonic() - at
    starts = _started(stack, book.book_id, "s1")
    assert starts[1]["dispatch_id"] != first["dispatch_id"] and starts[1]["detail"]["lost_starts"] == 1, starts
    assert gpu.alive()
    figure(f"job terminated ({sig}) by an operator mid-run: pair ready again {took:.1f}s later (lease {LEASE_TTL} s)")
