"""The beat's duties on a big idle catalog: tick, reconcile and a gate pass must not pay for idle pairs.

Idle pairs are `dirty` / `ready` (alternating), no commands, nothing active, loaded with
COPY: 10k = 10 books x 500 scenes x 2 stages; 1M = 1,000 books x 500 scenes x 2 stages
(quick mode: 100k = 100 books instead of 1M). The catalog is ANALYZEd after loading, as
autovacuum would do on a live system.

Timed: `gate.tick(rt.ports)` (its singleton lock deleted before each call),
`flow.reconcile.reconcile(rt.ports, force=True)` and `gate_pass` on one idle book. Baseline in the
same run: one Redis PING and one `SELECT 1` transaction through the same pool (the floor
of a call that makes one round trip to each store). Reconcile's statements are timed one
by one, and at the largest size every reconcile query is EXPLAIN ANALYZEd, so a query that
grows with idle pairs is named.
"""

from __future__ import annotations

from typing import Any

from bench.common import BenchResult, Context, analyze, make_runtime, median, pg_connect, reset_stores, timed
from bench.round_trips import count_round_trips
from bench.seed import BookShape, load_books

SCENES_PER_BOOK = 500

_EXPLAIN = {
    "books_with_work": (
        "SELECT book_id FROM commands WHERE status = 'active'"
        " UNION SELECT book_id FROM asset_states WHERE state IN ('pending', 'generating')",
        (),
    ),
    "generating_pairs": (
        "SELECT book_id, chapter_id, scene_id, stage, fencing_token, dispatch_id FROM asset_states"
        " WHERE state = 'generating'",
        (),
    ),
    "gate_rows.in_flight (one book)": (
        "SELECT a.chapter_id, a.scene_id, a.stage, a.state, a.fencing_token, s.position, a.dispatch_id,"
        " a.input_hash, s.input_hashes ->> a.stage, a.artifact_sha256 IS NOT NULL"
        " FROM asset_states a JOIN scenes s ON s.book_id = a.book_id AND s.chapter_id = a.chapter_id"
        "  AND s.scene_id = a.scene_id"
        " WHERE a.book_id = %s AND a.state IN ('pending', 'generating') ORDER BY s.position",
        ("idle-0000",),
    ),
    "prune_journal.by_age": ("DELETE FROM events WHERE at < now() - make_interval(secs => %s)", (7 * 86400.0,)),
    "prune_journal.by_count": ("DELETE FROM events WHERE id <= (SELECT max(id) - %s FROM events)", (1_000_000,)),
}


def explain_all() -> dict[str, dict[str, Any]]:
    """EXPLAIN (ANALYZE, BUFFERS) of each reconcile query, in a rolled-back transaction."""
    plans: dict[str, dict[str, Any]] = {}
    with pg_connect(autocommit=False) as conn:
        for name, (sql, params) in _EXPLAIN.items():
            rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT TEXT) " + sql, params).fetchall()
            lines = [r[0] for r in rows]
            execution = next((line for line in lines if line.startswith("Execution Time")), "")
            plans[name] = {"execution": execution, "plan": [line.strip() for line in lines[:6]]}
        conn.rollback()
    return plans


def measure(rt: Any, books: int, ctx: Context, *, explain: bool) -> dict[str, Any]:
    from animastor_tasks.flow import gate
    from animastor_tasks.flow import reconcile as reconcile_flow
    from animastor_tasks.flow.gate import gate_pass

    reset_stores()
    shapes = [BookShape(f"idle-{b:04d}", SCENES_PER_BOOK, 100) for b in range(books)]
    pairs = books * SCENES_PER_BOOK * 2
    ctx.log(f"tick_idle: loading {pairs:,} idle pairs")
    load_s, counts = timed(lambda: load_books(shapes, lambda _b, i, _st: "ready" if i % 2 == 0 else "dirty"))
    analyze_s, _ = timed(analyze)
    ctx.log(f"tick_idle: loaded in {load_s:.1f}s (+ANALYZE {analyze_s:.1f}s); measuring")

    lock = rt.redis.keys.lock("tick")

    def tick_once() -> float:
        rt.redis.client.delete(lock)
        seconds, books_ticked = timed(lambda: gate.tick(rt.ports))
        assert books_ticked == [], books_ticked
        return seconds

    def select_one() -> None:
        with rt.db.transaction() as conn:
            conn.execute("SELECT 1").fetchone()

    for _ in range(15):  # the pool, the imports, and psycopg's server-side prepare (after 5 runs of a statement)
        tick_once()
        select_one()
        rt.redis.ping()
        gate_pass(rt.ports, "idle-0000")
        reconcile_flow.reconcile(rt.ports, force=True)
    ticks = [tick_once() for _ in range(30)]
    pings = [timed(rt.redis.ping)[0] for _ in range(30)]
    selects = [timed(select_one)[0] for _ in range(30)]
    gates = [timed(lambda: gate_pass(rt.ports, "idle-0000"))[0] for _ in range(20)]
    reconciles = []
    with count_round_trips(rt) as trips:
        reconciles.append(timed(lambda: reconcile_flow.reconcile(rt.ports, force=True))[0])
    reconciles += [timed(lambda: reconcile_flow.reconcile(rt.ports, force=True))[0] for _ in range(4)]
    slowest = sorted(trips.statement_seconds.items(), key=lambda kv: -kv[1])[:4]
    out: dict[str, Any] = {
        "pairs": pairs,
        "books": books,
        "rows_loaded": counts,
        "load_seconds": round(load_s, 1),
        "tick_ms": median(ticks) * 1000,
        "reconcile_ms": median(reconciles) * 1000,
        "gate_ms": median(gates) * 1000,
        "redis_ping_ms": median(pings) * 1000,
        "pg_select1_tx_ms": median(selects) * 1000,
        "reconcile_round_trips": trips.describe(),
        "reconcile_slowest_statements_ms": {sql: round(s * 1000, 2) for sql, s in slowest},
    }
    if explain:
        out["explain"] = explain_all()
    return out


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    rt = make_runtime()
    try:
        small = measure(rt, 10, ctx, explain=False)
        big_books, label = (100, "100k") if ctx.quick else (1_000, "1m")
        big = measure(rt, big_books, ctx, explain=True)
    finally:
        rt.close()
        reset_stores()
    floor = f"redis PING {small['redis_ping_ms']:.2f} ms + pg SELECT 1 tx {small['pg_select1_tx_ms']:.2f} ms"

    def flat(a: float, b: float) -> bool:
        return b <= max(2 * a, a + 1.0)

    for key, name in (
        ("tick_ms", "tick_ms_idle"),
        ("reconcile_ms", "reconcile_ms_idle"),
        ("gate_ms", "gate_ms_idle_book"),
    ):
        result.figure(f"{name}_10k", small[key], "ms", baseline=floor)
        result.figure(
            f"{name}_{label}",
            big[key],
            "ms",
            baseline=f"10k: {small[key]:.2f} ms",
            target="flat vs 10k",
            ok=flat(small[key], big[key]),
        )
    result.notes["tick_idle"] = {"10k": small, label: big, "setup": __doc__.split("\n\n")[1].replace("\n", " ")}
    if not flat(small["reconcile_ms"], big["reconcile_ms"]):
        result.notes["tick_idle"]["reconcile_grows"] = (
            "reconcile grows with idle pairs; see explain/slowest statements at the large size"
        )
    return result
