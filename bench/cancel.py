"""Stop All on a busy book: how long `cancel` takes, and that nothing of the book starts afterwards.

Setup: one book of 5,008 scenes x 2 stages; 10,000 pairs `pending` under an active command
per stage, and the lane full: `lane_limit` (8) pairs per stage `generating` in the same
book with live leases, so cancel also releases and revokes running jobs. A fake consumer is
advertised on both GPU queues (nothing consumes), and one gate pass runs first, so the
pending pairs carry capacity deferrals exactly as on a live system.

Then `flow.cancel.cancel(rt.ports, book)` is timed (real Celery publisher: the revoke is a real
broadcast). Afterwards a gate pass, a tick (with the gate tasks it enqueues run in-process)
and a forced reconcile run; every `dispatch` / `job.started` event and every message
published to a GPU queue after the cancel counts as a job started after cancel (must be 0);
so does any of the running jobs' messages that, delivered anyway (`flow.generate.run_job`
in-process, as if the revoke lost the race), is not `fence_rejected`.
The freed lane makes this meaningful: if the gate let anything through, it would dispatch.

Baseline (same data, same run): the bare SQL of the release — one UPDATE of the book's
in-flight rows to `dirty` with RETURNING, rolled back — the floor for a cancel.
"""

from __future__ import annotations

from typing import Any

from bench.common import (
    BenchResult,
    Context,
    analyze,
    make_runtime,
    median,
    pg_connect,
    redis_client,
    reset_stores,
    timed,
)
from bench.round_trips import count_round_trips
from bench.seed import BookShape, activate, add_command, advertise_consumers, load_books

BOOK = "cancel-book"
PENDING_SCENES = 5_000
QUEUES = ("gpu.audio", "gpu.image")


def setup(rt: Any) -> dict[str, Any]:
    from animastor_tasks.flow.gate import gate_pass

    reset_stores()
    lane = {s.name: s.lane_limit for s in rt.settings.stages}
    running = max(lane.values())
    shape = BookShape(BOOK, PENDING_SCENES + running, 500)
    # The first scenes (reading order) hold the running jobs: lane_limit of them per stage.
    load_books([shape], lambda _b, i, stage: "generating" if i < lane[stage] else "pending")
    keys = shape.keys()
    for stage in lane:
        add_command(BOOK, stage, keys)
    analyze()
    with pg_connect() as conn:
        generating = conn.execute(
            "SELECT chapter_id, scene_id, stage, dispatch_id, fencing_token FROM asset_states"
            " WHERE book_id = %s AND state = 'generating'",
            (BOOK,),
        ).fetchall()
    specs = {s.name: s for s in rt.settings.stages}
    rt.ports.leases.take_leases(
        [
            (
                (BOOK, c, s, st),
                d,
                specs[st].lease_ttl,
                {"book": BOOK, "chapter": c, "scene": s, "stage": st, "token": t},
            )
            for c, s, st, d, t in generating
        ]
    )
    activate(rt, BOOK, keys)
    advertise_consumers(rt, QUEUES)
    before = gate_pass(rt.ports, BOOK)
    return {
        "pending": sum(1 for i in range(shape.scenes) for st in lane if i >= lane[st]),
        "generating": len(generating),
        "running": generating,
        "first_pass": dict(before.outcomes),
    }


def queue_depth(client: Any) -> int:
    return sum(int(client.llen(q)) for q in QUEUES)


def baseline_release_ms() -> float:
    """The bare UPDATE a cancel must do at least, rolled back."""
    with pg_connect(autocommit=False) as conn:
        seconds, _ = timed(
            lambda: conn.execute(
                "UPDATE asset_states SET state = 'dirty', updated_at = now() WHERE book_id = %s"
                " AND state IN ('pending', 'generating') RETURNING chapter_id, scene_id, stage, dispatch_id",
                (BOOK,),
            ).fetchall()
        )
        conn.rollback()
    return seconds * 1000


def once(rt: Any, ctx: Context) -> dict[str, Any]:
    from animastor_tasks.flow import cancel as cancel_flow
    from animastor_tasks.flow import gate
    from animastor_tasks.flow import reconcile as reconcile_flow
    from animastor_tasks.flow.gate import gate_pass
    from animastor_tasks.flow.generate import run_job
    from animastor_tasks.flow.job import Job

    info = setup(rt)
    base_ms = baseline_release_ms()
    client = redis_client()
    try:
        with pg_connect() as conn:
            mark = conn.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0]
        depth_before = queue_depth(client)
        with count_round_trips(rt) as trips:
            seconds, answer = timed(lambda: cancel_flow.cancel(rt.ports, BOOK))
        after = gate_pass(rt.ports, BOOK)
        client.delete(rt.redis.keys.lock("tick"))
        ticked = gate.tick(rt.ports)
        for book in ticked:  # what the control worker would run for the gate tasks the tick enqueued
            gate_pass(rt.ports, book)
        reconciled = reconcile_flow.reconcile(rt.ports, force=True)
        again = gate_pass(rt.ports, BOOK)
        # The running jobs' messages, delivered anyway (a revoke that lost the race): they must not start.
        late = [
            run_job(rt.ports, Job(BOOK, c, s, st, d, t), worker="bench@host")["outcome"]
            for c, s, st, d, t in info["running"]
        ]
        with pg_connect() as conn:
            started_events = conn.execute(
                "SELECT count(*) FROM events WHERE id > %s AND book_id = %s AND kind IN ('dispatch', 'job.started')",
                (mark, BOOK),
            ).fetchone()[0]
            in_flight = conn.execute(
                "SELECT count(*) FROM asset_states WHERE book_id = %s AND state IN ('pending', 'generating')", (BOOK,)
            ).fetchone()[0]
        published = queue_depth(client) - depth_before
    finally:
        client.close()
    ctx.log(f"cancel: {seconds * 1000:.1f} ms, released {answer['released']}, revoked {answer['revoked']}")
    info.pop("running")
    return {
        **info,
        "cancel_ms": seconds * 1000,
        "baseline_ms": base_ms,
        "round_trips": trips.describe(),
        "slowest_statements_ms": {
            sql: round(sec * 1000, 1) for sql, sec in sorted(trips.statement_seconds.items(), key=lambda kv: -kv[1])[:4]
        },
        "answer": {k: (len(v) if isinstance(v, list) else v) for k, v in answer.items()},
        "started_after": int(started_events) + max(0, published) + sum(1 for o in late if o != "fence_rejected"),
        "late_deliveries": {o: late.count(o) for o in set(late)},
        "dispatch_or_started_events_after": int(started_events),
        "messages_published_after": published,
        "in_flight_after": int(in_flight),
        "gate_after": {"authorized": len(after.authorized), "outcomes": dict(after.outcomes)},
        "gate_again": {"authorized": len(again.authorized), "outcomes": dict(again.outcomes)},
        "tick_books": ticked,
        "reconcile": reconciled,
    }


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    rt = make_runtime()
    try:
        runs = [once(rt, ctx) for _ in range(1 if ctx.quick else 3)]
    finally:
        rt.close()
    cancel_ms = median([r["cancel_ms"] for r in runs])
    base_ms = median([r["baseline_ms"] for r in runs])
    started = max(r["started_after"] for r in runs)
    result.figure(
        "cancel_return_ms_10k",
        cancel_ms,
        "ms",
        baseline=f"bare release UPDATE {base_ms:.1f} ms",
    )
    result.figure(
        "jobs_started_after_cancel",
        started,
        "jobs",
        baseline=f"in flight after: {max(r['in_flight_after'] for r in runs)}",
        target="== 0",
        ok=started == 0,
    )
    result.notes["cancel"] = {"runs": runs, "repeats": len(runs), "setup": __doc__.split("\n\n")[1].replace("\n", " ")}
    return result
