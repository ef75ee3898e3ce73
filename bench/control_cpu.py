"""Control-plane CPU per dispatched job, and the memory of a gate pass over 100k active pairs.

cpu_ms_per_job: one book of N/2 scenes x 2 stages `pending` under active commands, lane
limit / book quota / window raised (ANIMASTOR_STAGES) so that every pair may go, a fake
consumer advertised on both GPU queues; one gate pass dispatches all N for real (claim,
leases, journal, and one message per job published with the real Celery publisher to the
bench broker, where nothing consumes them). Measured: this process's `time.process_time()`
around the pass, and the CPU the Postgres backends it used (/proc/<pid>/stat) and the
Redis server (INFO cpu, the whole server: other clients included) spent meanwhile.
Baseline (same run): the CPU of publishing N bare messages with the same publisher.

gate_pass_rss_mb_100k (named control_rss_mb_100k before that figure became a whole tick cycle's,
bench/control_rss.py): a subprocess builds a runtime and runs one gate pass over 100k active
pairs (one book of 50,000 scenes x 2 stages, pending, commanded, capacity-deferred so the
pass decides without dispatching) and reports its own peak RSS (VmHWM: getrusage's maxrss
inherits the parent's peak across fork + exec on Linux, so it is kept only as a note).
Baseline: the same subprocess running the pass over a one-scene book.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import subprocess
import sys
import time
import uuid
from typing import Any

from bench.common import (
    ROOT,
    BenchResult,
    Context,
    analyze,
    make_runtime,
    pg_connect,
    proc_cpu_seconds,
    redis_client,
    redis_cpu_seconds,
    reset_stores,
    stage_table,
)
from bench.round_trips import count_round_trips
from bench.seed import BookShape, activate, add_command, add_deferrals, advertise_consumers, load_books

TARGET_CPU_MS = 5.0
QUEUES = ("gpu.audio", "gpu.image")
RSS_BOOK = "rss-book"
RSS_TINY = "rss-tiny"


def _book(rt: Any, book: str, scenes: int) -> list[tuple[str, str]]:
    shape = BookShape(book, scenes, 500)
    load_books([shape], lambda _b, _i, _st: "pending")
    keys = shape.keys()
    for stage in ("audio", "image"):
        add_command(book, stage, keys)
    activate(rt, book, keys)
    return keys


def dispatch_cpu(ctx: Context, jobs: int) -> dict[str, Any]:
    from animastor_tasks.flow.gate import gate_pass

    reset_stores()
    limit = jobs * 10
    rt = make_runtime(stage_table(lane_limit=limit, book_quota=limit, window=limit))
    try:
        advertise_consumers(rt, QUEUES)
        _book(rt, "warm-book", 10)
        _book(rt, "cpu-book", jobs // 2)
        analyze()
        warm = gate_pass(rt.ports, "warm-book")  # connections, plans, imports, the broker channel
        assert len(warm.dispatched) == 20, warm.outcomes

        redis_before = redis_cpu_seconds()
        with count_round_trips(rt) as trips:
            pids = set(trips.backend_pids)
            with rt.db.transaction() as conn:  # the pool's connection(s), before the pass
                pids.add(conn.info.backend_pid)
            pg_before = {pid: proc_cpu_seconds(pid) or 0.0 for pid in pids}
            cpu0, wall0 = time.process_time(), time.perf_counter()
            report = gate_pass(rt.ports, "cpu-book")
            cpu1, wall1 = time.process_time(), time.perf_counter()
        redis_after = redis_cpu_seconds()
        pg_cpu = 0.0
        pg_readable = True
        for pid in trips.backend_pids | pids:
            now = proc_cpu_seconds(pid)
            if now is None:
                pg_readable = False
                continue
            pg_cpu += now - pg_before.get(pid, 0.0)
        dispatched = len(report.dispatched)
        ctx.log(f"control_cpu: dispatched {dispatched} in {wall1 - wall0:.2f}s wall, {cpu1 - cpu0:.2f}s CPU")

        # Baseline: the same publisher, bare messages (what publishing alone costs per job).
        spec = rt.settings.registry.get("audio")
        kwargs = {"book_id": "x", "chapter_id": "c", "scene_id": "s", "stage": "audio", "fencing_token": 1}
        ids = [uuid.uuid4().hex for _ in range(dispatched)]
        pub0 = time.process_time()
        for dispatch_id in ids:
            rt.ports.publisher.publish_job(
                spec.task_name, spec.queue, dispatch_id, {**kwargs, "dispatch_id": dispatch_id}
            )
        pub1 = time.process_time()

        # Where the in-process CPU goes: a profiled pass over a smaller book.
        _book(rt, "profile-book", 200)
        profiler = cProfile.Profile()
        profiler.enable()
        profiled = gate_pass(rt.ports, "profile-book")
        profiler.disable()
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(12)
        top = [line.strip() for line in stream.getvalue().splitlines() if line.strip()][-13:]
        with pg_connect() as conn:
            journal = conn.execute("SELECT count(*) FROM events WHERE kind = 'dispatch'").fetchone()[0]
        client = redis_client()
        try:
            queued = sum(int(client.llen(q)) for q in QUEUES)
        finally:
            client.close()
    finally:
        rt.close()
    return {
        "jobs": jobs,
        "dispatched": dispatched,
        "outcomes": dict(report.outcomes),
        "wall_s": round(wall1 - wall0, 3),
        "cpu_s": round(cpu1 - cpu0, 3),
        "cpu_ms_per_job": (cpu1 - cpu0) * 1000 / max(1, dispatched),
        "publish_cpu_ms_per_msg": (pub1 - pub0) * 1000 / max(1, dispatched),
        "pg_backend_cpu_ms_per_job": pg_cpu * 1000 / max(1, dispatched) if pg_readable else None,
        "pg_backend_pids": sorted(trips.backend_pids | pids),
        "redis_server_cpu_ms_per_job": (redis_after - redis_before) * 1000 / max(1, dispatched),
        "round_trips": trips.describe(),
        "dispatch_events": journal,
        "messages_on_gpu_queues": queued,
        "profile_pass_dispatched": len(profiled.dispatched),
        "profile_top_tottime": top,
    }


def peak_rss_mb() -> float:
    """VmHWM of this process (peak RSS of its own address space), in MB.

    Not `getrusage().ru_maxrss`: Linux carries the parent's high-water mark across
    fork + exec into it, so a child of a big parent reports the parent's peak.
    """
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_child(book: str) -> dict[str, Any]:
    """Run in a fresh process: build the runtime, one gate pass over `book`, report peak RSS."""
    from bench.common import configure_environment

    configure_environment()
    from animastor_tasks.flow.gate import gate_pass

    rt = make_runtime()
    try:
        before = peak_rss_mb()
        started = time.perf_counter()
        report = gate_pass(rt.ports, book)
        seconds = time.perf_counter() - started
    finally:
        rt.close()
    return {
        "book": book,
        "maxrss_mb": peak_rss_mb(),
        "maxrss_before_pass_mb": before,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "pass_s": round(seconds, 3),
        "authorized": report.authorized_count,
        "outcomes": dict(report.outcomes),
    }


def run_child(book: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.control_cpu", "--rss-child", book],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"rss child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss(ctx: Context, pairs: int) -> dict[str, Any]:
    reset_stores()
    rt = make_runtime()
    try:
        keys = _book(rt, RSS_BOOK, pairs // 2)
        _book(rt, RSS_TINY, 1)
        analyze()
        add_deferrals(rt, RSS_BOOK, [(c, s, st) for c, s in keys for st in ("audio", "image")], "capacity", 3600)
        add_deferrals(rt, RSS_TINY, [("ch00000", "sc0000000", st) for st in ("audio", "image")], "capacity", 3600)
    finally:
        rt.close()
    ctx.log(f"control_cpu: {pairs:,} pairs loaded; measuring RSS in subprocesses")
    return {"baseline": run_child(RSS_TINY), "pass": run_child(RSS_BOOK)}


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    jobs = 500 if ctx.quick else 2000
    cpu = dispatch_cpu(ctx, jobs)
    result.figure(
        "cpu_ms_per_job",
        cpu["cpu_ms_per_job"],
        "ms CPU",
        baseline=f"bare publish {cpu['publish_cpu_ms_per_msg']:.2f} ms/msg",
        target=f"<= {TARGET_CPU_MS:g}",
        ok=cpu["cpu_ms_per_job"] <= TARGET_CPU_MS,
    )
    if cpu["pg_backend_cpu_ms_per_job"] is not None:
        result.figure("pg_backend_cpu_ms_per_job", cpu["pg_backend_cpu_ms_per_job"], "ms CPU", baseline="postgres")
    result.figure(
        "redis_server_cpu_ms_per_job", cpu["redis_server_cpu_ms_per_job"], "ms CPU", baseline="whole redis server"
    )
    mem = rss(ctx, 100_000)
    result.figure(
        "gate_pass_rss_mb_100k",
        mem["pass"]["maxrss_mb"],
        "MB",
        baseline=f"1-scene pass {mem['baseline']['maxrss_mb']:.1f} MB",
    )
    result.notes["control_cpu"] = {"dispatch": cpu, "rss": mem, "setup": __doc__.split("\n\n")[1].replace("\n", " ")}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.control_cpu")
    parser.add_argument("--rss-child", metavar="BOOK", required=True, help="run one gate pass and print peak RSS")
    args = parser.parse_args()
    print(json.dumps(rss_child(args.rss_child)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
