"""Where one GPU job's time goes: each step of its run, in one process, with nothing else running.

One book is regenerated (audio, the default lane of 8, a consumer advertised), then its jobs run one
after another in this process through the real `run_job`, as a GPU worker runs a delivered job: the
start check, the builtin generator, the commit, and the refill of the freed slot, whose claim is
published to the bench broker (nothing consumes it there). The flow's steps and the adapters' calls
are timed by wrapping them; nothing else changes.

- `job_ms_in_process`: wall time per job, median over the jobs after a warm-up;
- `job_round_trips`: Redis commands and pipelines plus Postgres statements per job (`bench.round_trips`).

Beside them, in the same run, the floors a round trip sets through the same runtime: a Redis PING, a
Postgres `SELECT 1` transaction through the pool, and a one-row write transaction.

The notes give each timed step's mean ms per job (steps nest: a flow step includes the calls made in
it). No targets: this says where the time goes that bounds `dispatch_jobs_per_s` and `latency_p50_ms`.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from bench.common import BenchResult, Context, analyze, make_runtime, median
from bench.round_trips import RoundTrips, count_round_trips
from bench.seed import BookShape, advertise_consumers, load_books

BOOK = "steps-book"
WARM_UP = 20

# (where, the attributes timed there): the flow's steps, then the adapters' calls of a job's run.
FLOW_STEPS = {
    "animastor_tasks.flow.generate": ("_start", "_generate_with_retries", "_wind_down", "_Delivered.end"),
    "animastor_tasks.flow.refill": ("free_slot",),
    "animastor_tasks.flow.dispatch": ("_claim_and_publish",),
    "animastor_tasks.flow.publish": ("publish_claims",),
}
PORT_CALLS = {
    "jobs": ("commit_job",),
    "leases": ("start_delivery", "take_leases", "release_lease", "end_delivery"),
    "deferrals": ("next_waiters", "clear_deferrals", "defer"),
    "assets": ("gate_candidates",),
    "book_state": ("pair_snapshot",),
    "publisher": ("publish_job",),
    "counters": ("add", "observe"),
    "artifacts": ("put",),
}
HELD_OPEN = {"assets": "claiming", "jobs": "starting"}  # context managers: timed from open to close


def _timed(spent: dict[str, float], label: str, call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - started

    return timed


def _timed_open(spent: dict[str, float], label: str, opener: Callable[..., AbstractContextManager[Any]]) -> Any:
    @contextmanager
    def held(*args: Any, **kwargs: Any) -> Iterator[Any]:
        started = time.perf_counter()
        try:
            with opener(*args, **kwargs) as value:
                yield value
        finally:
            spent[label] += time.perf_counter() - started

    return held


@contextmanager
def timing(ports: Any) -> Iterator[dict[str, float]]:
    """Every step above wrapped while the block runs; seconds spent in each, by label."""
    spent: dict[str, float] = defaultdict(float)
    undo: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str, how: Callable[..., Any] = _timed) -> None:
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, how(spent, label, getattr(owner, name)))

    for module_name, names in FLOW_STEPS.items():
        module = importlib.import_module(module_name)
        for name in names:
            *within, attribute = name.split(".")  # a method: its class, then its name
            owner = functools.reduce(getattr, within, module)
            wrap(owner, attribute, f"{module_name.rsplit('.', 1)[1]}.{name}")
    for port, names in PORT_CALLS.items():
        for name in names:
            wrap(getattr(ports, port), name, f"{port}.{name}")
    for port, name in HELD_OPEN.items():
        wrap(getattr(ports, port), name, f"{port}.{name} (open to commit)", _timed_open)
    try:
        yield spent
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


def _next_job(rt: Any, book: str) -> Any:
    """The pair claimed longest ago that is still generating: the jobs run in the order they were claimed.
    Read through the runtime's own pool: a connection opened for it (and its backend's exit) cost more
    than the job's own start transaction."""
    from animastor_tasks.flow.job import Job

    with rt.db.read() as conn:
        row = conn.execute(
            "SELECT chapter_id, scene_id, stage, dispatch_id, fencing_token FROM asset_states"
            " WHERE book_id = %s AND state = 'generating' ORDER BY updated_at, scene_id LIMIT 1",
            (book,),
        ).fetchone()
    return None if row is None else Job(book, *row)


def _run_jobs(rt: Any, count: int, trips: RoundTrips | None = None) -> list[float]:
    """Run the book's next `count` jobs one after another; each one's wall time. `trips`: where to add the
    round trips of the jobs' runs (not of reading which job is next)."""
    from animastor_tasks.flow.generate import run_job

    walls: list[float] = []
    for n in range(count):
        job = _next_job(rt, BOOK)
        if job is None:
            raise RuntimeError(f"no job left to run after {n}")
        with count_round_trips(rt) as counted:
            started = time.perf_counter()
            outcome = run_job(rt.ports, job, worker="bench@steps")["outcome"]
            walls.append(time.perf_counter() - started)
        if trips is not None:
            trips.add(counted)
        if outcome != "ready":
            raise RuntimeError(f"job {n} ended {outcome}, not ready")
    return walls


def _floors(rt: Any) -> dict[str, float]:
    """Median ms of a Redis PING, a `SELECT 1` transaction and a one-row write transaction, through `rt`."""

    def select_one() -> None:
        with rt.db.transaction() as conn:
            conn.execute("SELECT 1").fetchone()

    def write_one() -> None:
        with rt.db.transaction() as conn:
            conn.execute("UPDATE books SET title = title WHERE book_id = %s", (BOOK,))

    floors: dict[str, float] = {}
    for name, step in (
        ("redis_ping_ms", rt.redis.ping),
        ("pg_select1_tx_ms", select_one),
        ("pg_write_tx_ms", write_one),
    ):
        times = []
        for _ in range(200):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        floors[name] = round(median(times[20:]) * 1000, 3)
    return floors


def run(ctx: Context) -> BenchResult:
    from animastor_tasks.flow.regenerate import regenerate

    jobs = 100 if ctx.quick else 300
    result = BenchResult()
    load_books([BookShape(BOOK, jobs + WARM_UP + 20)], lambda _b, _i, _s: "dirty", ["audio"])
    analyze()
    rt = make_runtime()
    try:
        advertise_consumers(rt, ["gpu.audio", "gpu.image"])
        regenerate(rt.ports, BOOK, ["audio"])
        _run_jobs(rt, WARM_UP)  # connections, prepared statements, imports
        trips = RoundTrips()
        with timing(rt.ports) as spent:
            walls = _run_jobs(rt, jobs, trips)
        floors = _floors(rt)
    finally:
        rt.close()
    wall = median(walls) * 1000
    steps = {label: round(seconds * 1000 / jobs, 3) for label, seconds in sorted(spent.items(), key=lambda s: -s[1])}
    ctx.log(f"job_steps: {jobs} jobs, {wall:.2f} ms each (median); {trips.describe()} in all")
    floor = (
        f"redis PING {floors['redis_ping_ms']:.2f} ms, pg SELECT 1 tx {floors['pg_select1_tx_ms']:.2f} ms,"
        f" pg write tx {floors['pg_write_tx_ms']:.2f} ms"
    )
    result.figure("job_ms_in_process", wall, "ms", baseline=f"median of {jobs} jobs; {floor}")
    result.figure("job_round_trips", trips.total / jobs, "", baseline=f"per job; {trips.describe()} for {jobs} jobs")
    result.notes["job_steps"] = {
        "jobs": jobs,
        "ms_per_job": steps,
        "floors": floors,
        "setup": " ".join(__doc__.split("\n\n")[1].split()),
    }
    return result
