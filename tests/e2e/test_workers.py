"""Worker start-up refusal and consumer presence, with real worker processes."""

from __future__ import annotations

import signal
import time

import pytest

from .harness import audio_stage, stage_table, wait_for

pytestmark = pytest.mark.e2e


def test_worker_on_an_unknown_queue_exits_2_naming_it(make_stack, figure) -> None:
    stack = make_stack()
    began = time.monotonic()
    done = stack.cluster.run(["worker", "-Q", "gpu.nope", "-c", "1", "-n", "nope@%h", "-l", "info"], timeout=60)
    took = time.monotonic() - began
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "refusing to consume unknown queue(s) gpu.nope" in done.stderr, done.stderr
    assert "ready." not in output
    assert stack.rt.presence.live_consumers(["gpu.nope"]) == {"gpu.nope": {}}
    last = [line for line in done.stderr.strip().splitlines() if "gpu.nope" in line][-1]
    figure(f"exit code {done.returncode} after {took:.1f}s; stderr: {last.strip()[:160]}")


def test_presence_follows_worker_lifecycle_and_add_consumer(make_stack, figure) -> None:
    stack = make_stack()
    cluster, ttl = stack.cluster, stack.settings.presence_ttl_seconds
    coord = stack.rt
    first = cluster.gpu("audio", wait=False)
    second = cluster.gpu("audio", wait=False)

    # Appears within a few seconds of start, no later than the worker is ready (its first beat, holding, comes
    # before the consumer starts).
    host = wait_for(lambda: cluster.advertised(first), 45, interval=0.02, what="first worker advertised")
    appear = time.monotonic() - first.started_at
    first.wait_log(" ready.", timeout=5)
    cluster.wait_ready(second)
    other = second.hostname
    assert set(coord.presence.live_consumers(["gpu.audio"])["gpu.audio"]) == {host, other}

    # add_consumer at runtime: the audio worker shows up under gpu.image at its next heartbeat.
    sent = time.monotonic()
    done = cluster.run(["control", "add_consumer", "gpu.image", "-d", host], timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "add consumer gpu.image" in done.stdout + done.stderr, done.stdout + done.stderr
    wait_for(lambda: cluster.advertised(first, "gpu.image") == host, ttl, what="advertised under gpu.image")
    added = time.monotonic() - sent
    assert cluster.advertised(first, "gpu.audio") == host
    assert cluster.advertised(second, "gpu.image") is None

    # Clean shutdown: the entries are withdrawn (removed from the sets, not left to expire).
    stopped = time.monotonic()
    assert cluster.stop(first) == 0, first.tail()
    stop_took = time.monotonic() - stopped
    for queue in ("gpu.audio", "gpu.image"):
        assert coord.redis.client.zscore(coord.redis.keys.consumers(queue), host) is None, queue
    assert set(coord.presence.live_consumers(["gpu.audio"])["gpu.audio"]) == {other}

    # SIGKILL: nothing withdraws the entry; it stops counting within one TTL.
    cluster.kill(second, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: other not in coord.presence.live_consumers(["gpu.audio"])["gpu.audio"], ttl + 0.5, what="expired")
    gone = time.monotonic() - killed
    assert gone <= ttl + 0.5
    assert (
        coord.redis.client.zscore(coord.redis.keys.consumers("gpu.audio"), other) is not None
    )  # expired, not withdrawn
    assert stack.rt.presence.counts(["gpu.audio", "gpu.image"]) == {"gpu.audio": 0, "gpu.image": 0}
    figure(
        f"advertised {appear:.2f}s after the process started; add_consumer -> under gpu.image in {added:.2f}s; "
        f"SIGTERM stop {stop_took:.2f}s, entries withdrawn; SIGKILL -> gone after {gone:.2f}s (TTL {ttl:.0f}s)"
    )


def test_gpus_option_pins_one_gpu_per_pool_child(make_stack, figure) -> None:
    """`--gpus 3,5` (ANIMASTOR_GPU_IDS): each of the two pool children runs its jobs on its own GPU."""
    import re

    from tests.integration.helpers import make_book

    stack = make_stack()
    cluster = stack.cluster
    procs = [
        cluster.control(wait=False),
        cluster.gpu("audio", concurrency=2, env={"ANIMASTOR_GPU_IDS": "3,5"}, wait=False),
    ]
    cluster.wait_ready(*procs)
    book = make_book("gpu-book", chapters=2, scenes=4)
    stack.rt.catalog.import_book(book)
    stack.client.regenerate(book.book_id, ["audio"])
    stack.wait_commands(book.book_id, ["audio"], "completed", timeout=45)
    # The pairs are committed before each task returns: wait for the worker to log the last result.
    wait_for(lambda: len(re.findall(r"succeeded in .*'gpu'", procs[1].log())) >= 8, 10, "8 results logged")
    gpus = re.findall(r"succeeded in .*'gpu': '(\d+)'", procs[1].log())
    assert len(gpus) == 8 and set(gpus) <= {"3", "5"}, gpus
    children = set(re.findall(r"ForkPoolWorker-(\d+)\].*succeeded in .*'gpu': '(\d+)'", procs[1].log()))
    assert len({gpu for _, gpu in children}) == len({child for child, _ in children})  # one GPU per child
    figure(f"8 jobs on 2 pool children; GPUs seen {sorted(set(gpus))}; child->gpu {sorted(children)}")


def test_a_stage_whose_only_worker_is_replaced_keeps_its_commands(make_stack, figure) -> None:
    """A deployment replacing the stage's only worker (`docker compose up` recreates its container): the old one
    finishes its job and stops cleanly, the new one consumes seconds later. Old code: a tick in between found jobs
    queued and no consumer, and BLOCKED the command for good."""
    stack = make_stack(stages=stage_table(audio=audio_stage(params={"steps": 4, "step_seconds": 0.25})))
    run_replaced_worker(stack, figure, "")


def run_replaced_worker(stack, figure, broker: str, scenes: int = 6) -> None:  # type: ignore[no-untyped-def]
    """The stage's only worker replaced while its first job runs: the command completes."""
    from tests.integration.helpers import make_book

    cluster = stack.cluster
    control, beat, old = cluster.control(wait=False), cluster.beat(wait=False), cluster.gpu("audio", wait=False)
    cluster.wait_ready(control, beat, old)
    book = make_book("replaced-worker", chapters=1, scenes=scenes)
    stack.rt.catalog.import_book(book)
    stack.client.regenerate(book.book_id, ["audio"])
    old.wait_log(" started on ", timeout=20)  # its first job runs
    stopped = time.monotonic()
    new = cluster.restart(old)  # SIGTERM, the running job finished first; a successor under a new name
    gap = time.monotonic() - stopped
    rows = stack.wait_commands(book.book_id, ["audio"], "completed", timeout=60)
    assert rows["audio"].status == "completed" and new.alive()
    figure(f"only audio worker replaced{broker}: {gap:.1f}s from SIGTERM to its successor ready; the command completed")
