"""A control process run in-process, so a tick cycle can be timed and its memory read.

`python -m bench.control_loop SPEC_JSON` is a fresh process that does what the control worker
does, without the broker's wait in between: it runs the contract's `animastor.tick` task, then
takes every message the tick (and the passes it ran) put on `animastor.control` off the broker
and runs its task here (`Task.apply`, the same code a worker runs), until the queue is empty.
That is one tick cycle: whatever the dispatch design asks of the control plane, it is measured.

With `free` set, the jobs the previous cycle dispatched are first run to completion here
through the contract's `animastor.generate.<stage>` task (builtin generator, instant), untimed,
so every cycle starts with the lane slots those jobs held freed by real completions; the
completions' own control messages are part of the cycle that follows, their refills included
(a GPU worker runs those in the finished job's process; here they go to the control queue).

It prints one JSON line: per cycle its wall and CPU seconds, the control tasks it ran, the jobs
it published to the GPU queues; and the process's peak RSS (VmHWM) before and after. With `reconcile`
set, it then runs the beat's reconcile task once and adds its wall time (`reconcile_ms`).
The parent side is `run_control_process`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from bench.common import ROOT, bench_env

CONTROL = "animastor.control"
MAX_MESSAGES = 500_000  # a cycle that runs more control tasks than this is reported as runaway


def peak_rss_mb() -> float:
    """VmHWM of this process: its own peak RSS (ru_maxrss carries a parent's peak across exec)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class ControlLoop:
    """The control worker's work, run here: tick, then every control message until none is left."""

    def __init__(self, queues: list[str]) -> None:
        from animastor_tasks.worker import tasks  # registers the contract's tasks on the app
        from animastor_tasks.worker.wiring import current

        self.app = tasks.app
        self.wiring = current()
        self.queues = queues
        self.conn = self.app.connection_for_read()
        self.channel = self.conn.default_channel
        self.errors: list[str] = []

    def _take(self, queue: str) -> tuple[str, str, list[Any], dict[str, Any]] | None:
        message = self.channel.basic_get(queue, no_ack=True)
        if message is None:
            return None
        args, kwargs, _embed = message.decode()
        return message.headers["task"], message.headers["id"], list(args), dict(kwargs)

    def _apply(self, name: str, task_id: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        result = self.app.tasks[name].apply(args=args, kwargs=kwargs, task_id=task_id)
        if result.failed() and len(self.errors) < 20:
            self.errors.append(f"{name}: {result.result!r}")

    def drain_control(self) -> Counter[str]:
        ran: Counter[str] = Counter()
        while sum(ran.values()) < MAX_MESSAGES:
            taken = self._take(CONTROL)
            if taken is None:
                break
            ran[taken[0]] += 1
            self._apply(*taken)
        return ran

    def cycle(self) -> dict[str, Any]:
        """One timed tick cycle."""
        self.wiring.redis.client.delete(self.wiring.redis.keys.lock("tick"))
        cpu0, wall0 = time.process_time(), time.perf_counter()
        self._apply("animastor.tick", "bench-tick", [], {})
        ran = self.drain_control()
        if sum(ran.values()) >= MAX_MESSAGES:
            self.errors.append(f"runaway cycle: {MAX_MESSAGES} control tasks and the queue not empty")
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        return {"ms": wall * 1000, "cpu_ms": cpu * 1000, "control_tasks": dict(ran), "queued_jobs": self.queued()}

    def queued(self) -> int:
        """Job messages waiting on the GPU queues (every priority list of kombu's Redis transport)."""
        return sum(int(self.channel._size(queue)) for queue in self.queues)

    def finish_jobs(self) -> int:
        """Run every queued GPU job here to completion (untimed); their control messages stay queued.

        A job that ends ready refills its slot in its own process; here that refill is sent to the control
        queue instead (as when it fails in a GPU worker), so the refill work is timed in the next cycle."""
        from animastor_tasks.flow import refill

        inline = refill.free_slot

        def sent_on(ports: Any, book: str, queue: str, dispatch_id: str, *, here: bool = False, **rest: Any) -> None:
            rest.pop("after", None)  # a job's held-back clean-up stands for `here`: run at once instead
            inline(ports, book, queue, dispatch_id, here=False, **rest)

        refill.free_slot = sent_on
        done = 0
        try:
            for queue in self.queues:
                while (taken := self._take(queue)) is not None:
                    self._apply(*taken)
                    done += 1
        finally:
            refill.free_slot = inline
        return done

    def close(self) -> None:
        self.conn.release()
        self.wiring.close()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    loop = ControlLoop(spec["queues"])
    started_mb = peak_rss_mb()
    cycles: list[dict[str, Any]] = []
    budget = time.monotonic() + spec.get("budget_s", 60.0)
    reconcile_ms = 0.0
    try:
        for n in range(spec["cycles"]):
            finished = loop.finish_jobs() if spec.get("free") and n > 0 else 0
            out = loop.cycle()
            out["jobs_finished_before"] = finished
            cycles.append(out)
            if n >= 1 and time.monotonic() > budget:
                break  # slow cycles: fewer samples rather than an endless benchmark
        if spec.get("reconcile"):  # the beat's repair pass, once, after the cycles
            started = time.perf_counter()
            loop._apply("animastor.reconcile", "bench-reconcile", [], {})
            reconcile_ms = (time.perf_counter() - started) * 1000
    finally:
        loop.close()
    out = {"cycles": cycles, "rss_start_mb": started_mb, "rss_peak_mb": peak_rss_mb(), "errors": loop.errors}
    return {**out, "reconcile_ms": reconcile_ms} if spec.get("reconcile") else out


def run_control_process(spec: dict[str, Any], stages: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Run `child(spec)` in a fresh process on the bench stores with this stage table."""
    env = {**os.environ, **bench_env(stages), "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-m", "bench.control_loop", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"control process failed ({out.returncode}): {out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
