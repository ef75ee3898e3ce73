"""Run the benchmarks: `python -m bench.run [--quick] [--only NAME[,NAME]]`.

Prints one table (figure, value, baseline measured in the same run, target, PASS/FAIL)
and writes `bench/results.json` as `{"figures": {...}, "notes": {...}, "machine": {...}}`.
With `--only`, figures of the benchmarks not run are kept from the previous results file.
A benchmark that fails is reported (notes.errors) and the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from typing import Any

from animastor_tasks.errors import StoreUnavailable
from bench.common import ROOT, BenchResult, Context, configure_environment, prepare_stores, reset_stores

BENCHES = (
    "gate_pass",
    "latency",
    "cancel",
    "tick_idle",
    "tick_active",
    "tick_cycle",
    "reconcile_rounds",
    "control_cpu",
    "control_rss",
    "lane_busy",
    "lone_book",
    "interactive",
    "forced_rerun",
    "idle_books",
    "refill_read",
    "busy_commands",
    "big_book_regenerate",
    "unseen_book",
    "throughput",
    "job_steps",
)
RESULTS = os.path.join(ROOT, "bench", "results.json")


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import celery
    import psycopg
    import redis

    from bench.common import pg_connect, redis_client

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    with pg_connect() as conn:
        pg_version = conn.execute("SHOW server_version").fetchone()[0]
    client = redis_client()
    try:
        redis_version = client.info("server")["redis_version"]
    finally:
        client.close()
    try:
        with open("/proc/meminfo") as handle:
            mem_kb = int(handle.readline().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kb = 0
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(mem_kb / 1024 / 1024, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "postgres": pg_version,
        "redis": redis_version,
        "celery": celery.__version__,
        "redis_py": redis.__version__,
        "psycopg": psycopg.__version__,
        "loadavg_start": os.getloadavg(),
    }


def print_table(results: dict[str, BenchResult]) -> None:
    header = ("figure", "value", "unit", "baseline (same run)", "target", "")
    lines = [header]
    for result in results.values():
        for row in result.rows:
            value = f"{row.value:,.3f}" if isinstance(row.value, float) else str(row.value)
            lines.append((row.name, value, row.unit, row.baseline, row.target, row.verdict))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * width for width in widths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer samples (about a minute each)")
    parser.add_argument("--only", action="append", default=[], help=f"run only these ({', '.join(BENCHES)})")
    parser.add_argument("--output", default=RESULTS, help="where to write the JSON results")
    args = parser.parse_args(argv)
    only = [name for value in args.only for name in value.split(",") if name]
    unknown = [name for name in only if name not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHES)}")
    names = [name for name in BENCHES if not only or name in only]

    configure_environment()
    try:
        prepare_stores()
    except StoreUnavailable as err:
        print(
            f"error: {err}\nThe benchmarks need PostgreSQL and Redis over TCP: BENCH_DATABASE_URL (default"
            " postgresql://postgres@127.0.0.1:5432/animastor_bench) and BENCH_REDIS_URL (default"
            " redis://127.0.0.1:6379/13).",
            file=sys.stderr,
        )
        return 3
    ctx = Context(quick=args.quick)
    info = machine()
    results: dict[str, BenchResult] = {}
    durations: dict[str, float] = {}
    errors: dict[str, str] = {}
    loads: dict[str, dict[str, float]] = {}
    started = time.perf_counter()
    for name in names:
        load = os.getloadavg()
        # The machine is shared: a high load average at the start says the figures below are noisy.
        print(f"== {name} (load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} cores)", flush=True)
        loads[name] = {"start": load[0]}
        t0 = time.perf_counter()
        try:
            reset_stores()
            module = importlib.import_module(f"bench.{name}")
            results[name] = module.run(ctx)
        except Exception as err:  # one broken benchmark must not hide the others' figures
            errors[name] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        finally:
            durations[name] = round(time.perf_counter() - t0, 1)
            loads[name]["end"] = os.getloadavg()[0]
            print(f"   {name} took {durations[name]:.1f}s", flush=True)
    try:
        reset_stores()
    except Exception as err:
        errors["cleanup"] = str(err)
    info["loadavg_end"] = os.getloadavg()

    print()
    print_table(results)
    print(f"\ntotal {time.perf_counter() - started:.1f}s ({'quick' if args.quick else 'full'})")
    for name, error in errors.items():
        print(f"ERROR {name}: {error}", file=sys.stderr)

    figures: dict[str, Any] = {}
    notes: dict[str, Any] = {}
    if (only or errors) and os.path.exists(args.output):  # a benchmark that failed keeps its last figures
        try:
            with open(args.output) as handle:
                previous = json.load(handle)
            figures.update(previous.get("figures", {}))
            notes.update(previous.get("notes", {}))
        except (OSError, ValueError):
            pass
    for name, result in results.items():
        figures.update(result.figures)
        notes[name] = {
            **result.notes,
            "rows": [
                {
                    "name": r.name,
                    "value": r.value,
                    "unit": r.unit,
                    "baseline": r.baseline,
                    "target": r.target,
                    "verdict": r.verdict,
                }
                for r in result.rows
            ],
        }
    notes["run"] = {
        "mode": "quick" if args.quick else "full",
        "benchmarks": names,
        "durations_seconds": durations,
        "loadavg_1min": loads,
        "note": "other engineers' tests share this 2-core machine; a high 1-min load average means noisy figures",
        "errors": errors,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with open(args.output, "w") as handle:
        json.dump({"figures": figures, "notes": notes, "machine": info}, handle, indent=2, default=str)
        handle.write("\n")
    print(f"wrote {args.output}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
