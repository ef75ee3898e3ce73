"""Gate pass cost per active pair, its round trips, and a per-pair reference doing the same decisions.

Setup per size: ONE book with N/2 scenes x 2 stages, every pair `pending`, one active
command per stage covering every scene, every pair deferred in the `capacity` bucket (so
the pass decides and skips, it never claims: this is the gate itself), every scene in
the active index. 100k pairs = one book of 50,000 scenes (the worst case for one pass:
the gate is per book, so 50 books x 1000 scenes costs 50 passes of the 1k figure).

The reference does what the legacy runtime did, pair by pair: one Redis EXISTS of the
cancel flag, one Postgres query each for the tombstone, the layer config and an active
command covering the pair, and one Redis read of the pair's deferral (a 3-ZSCORE pipeline,
one round trip). It lists the in-flight pairs with one query and runs all its queries in
one transaction on one pooled connection (the most favourable set-up it can have).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from bench.common import (
    BenchResult,
    BookShape,
    Context,
    Row,
    activate,
    add_command,
    add_deferrals,
    analyze,
    count_round_trips,
    load_books,
    make_runtime,
    median,
    pg_connect,
    reset_stores,
    timed,
)

BOOK = "gate-book"
TARGET_SPEEDUP = 20.0
TARGET_US_PER_PAIR = 20.0
LAYERS = '{"audio_enabled": true, "image_enabled": true}'


def setup(rt: Any, pairs: int) -> BookShape:
    """One book of pairs/2 scenes x 2 stages, all pending, commanded and capacity-deferred."""
    reset_stores()
    shape = BookShape(BOOK, pairs // 2, 500)
    load_books([shape], lambda _b, _i, _st: "pending")
    keys = shape.keys()
    for stage in ("audio", "image"):
        add_command(BOOK, stage, keys)
    analyze()
    add_deferrals(rt, BOOK, [(c, s, st) for c, s in keys for st in ("audio", "image")], "capacity", 3600)
    activate(rt, BOOK, keys)
    return shape


def reference_pass(rt: Any, book: str) -> dict[str, Any]:
    """The legacy per-pair gate: the same decisions, paid pair by pair."""
    from animastor_tasks.domain.gate import BookFacts, decide
    from animastor_tasks.domain.keys import DEFER_BUCKETS, pair_member

    client = rt.redis.client
    keys = rt.redis.keys
    now = time.time()
    authorized: list[tuple[str, str, str]] = []
    denied: dict[tuple[str, str, str], str] = {}
    outcomes: Counter[str] = Counter()
    with rt.db.transaction() as conn:
        in_flight = conn.execute(
            "SELECT a.chapter_id, a.scene_id, a.stage, a.state FROM asset_states a JOIN scenes s"
            " ON s.book_id = a.book_id AND s.chapter_id = a.chapter_id AND s.scene_id = a.scene_id"
            " WHERE a.book_id = %s AND a.state IN ('pending', 'generating') ORDER BY s.position",
            (book,),
        ).fetchall()
        for chapter, scene, stage, state in in_flight:
            pair = (chapter, scene, stage)
            flag = bool(client.exists(keys.cancel_flag(book)))
            tombstone = conn.execute("SELECT 1 FROM cancel_tombstones WHERE book_id = %s", (book,)).fetchone()
            layers = conn.execute("SELECT layer_config FROM books WHERE book_id = %s", (book,)).fetchone()
            commanded = conn.execute(
                "SELECT 1 FROM command_targets t JOIN commands c ON c.command_id = t.command_id"
                " WHERE t.book_id = %s AND t.chapter_id = %s AND t.scene_id = %s AND t.stage = %s"
                " AND c.status = 'active' LIMIT 1",
                (book, chapter, scene, stage),
            ).fetchone()
            facts = BookFacts(
                layers is not None,
                flag,
                tombstone is not None,
                None if layers is None else layers[0],
                frozenset({pair}) if commanded else frozenset(),
            )
            reason = decide(facts, pair)
            if reason is not None:
                denied[pair] = str(reason)
                continue
            authorized.append(pair)
            if state != "pending":
                continue
            pipe = client.pipeline(transaction=False)
            member = pair_member(*pair)
            for bucket in DEFER_BUCKETS:
                pipe.zscore(keys.deferrals(book, bucket), member)
            if any(score is not None and float(score) > now for score in pipe.execute()):
                outcomes["deferred_capacity"] += 1
    return {"authorized": authorized, "denied": denied, "outcomes": outcomes}


def measure(rt: Any, pairs: int, reps: int, *, reference: bool, warm: int, ctx: Context) -> dict[str, Any]:
    from animastor_tasks.flow.gate import gate_pass

    ctx.log(f"gate_pass: loading {pairs:,} pairs")
    load_s, _ = timed(lambda: setup(rt, pairs))
    ctx.log(f"gate_pass: loaded in {load_s:.1f}s; measuring")
    for _ in range(warm):  # pool connection, imports, and psycopg's server-side prepare (after 5 runs)
        gate_pass(rt.ports, BOOK)
    with count_round_trips(rt) as trips:
        report = gate_pass(rt.ports, BOOK)
    with count_round_trips(rt) as trips_nodispatch:
        gate_pass(rt.ports, BOOK, dispatch_work=False)
    full = [timed(lambda: gate_pass(rt.ports, BOOK))[0] for _ in range(reps)]
    nodispatch = [timed(lambda: gate_pass(rt.ports, BOOK, dispatch_work=False))[0] for _ in range(reps)]
    layered: list[float] = []
    if pairs == 10_000:  # the same pass once the book has a layer config (the JSON every book with layers has)
        with pg_connect() as conn:
            conn.execute("UPDATE books SET layer_config = %s WHERE book_id = %s", (LAYERS, BOOK))
        gate_pass(rt.ports, BOOK)
        layered = [timed(lambda: gate_pass(rt.ports, BOOK))[0] for _ in range(reps)]
        with pg_connect() as conn:
            conn.execute("UPDATE books SET layer_config = NULL WHERE book_id = %s", (BOOK,))
    out: dict[str, Any] = {
        "gate_layers_s": median(layered) if layered else None,
        "pairs": pairs,
        "load_s": round(load_s, 2),
        "gate_s": median(full),
        "gate_nodispatch_s": median(nodispatch),
        "trips": trips,
        "trips_nodispatch": trips_nodispatch,
        "authorized": len(report.authorized),
        "outcomes": dict(report.outcomes),
        "dispatched": len(report.dispatched),
    }
    if reference:
        ref_reps = max(1, reps // 3) if pairs <= 1000 else 1
        runs = []
        ref: dict[str, Any] = {}
        for _ in range(ref_reps):
            with count_round_trips(rt) as ref_trips:
                seconds, ref = timed(lambda: reference_pass(rt, BOOK))
            runs.append(seconds)
        out["reference_s"] = median(runs)
        out["reference_trips"] = ref_trips
        out["decisions_equal"] = (
            ref["authorized"] == report.authorized
            and ref["denied"] == {k: str(v) for k, v in report.denied.items()}
            and ref["outcomes"]["deferred_capacity"] == report.outcomes.get("deferred_capacity", 0)
        )
    return out


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    rt = make_runtime()
    try:
        sizes = [(1_000, 15, True, 6), (10_000, 9, True, 1), (100_000, 1 if ctx.quick else 3, False, 1)]
        measured = {
            m["pairs"]: m
            for m in (measure(rt, n, reps, reference=ref, warm=warm, ctx=ctx) for n, reps, ref, warm in sizes)
        }
    finally:
        rt.close()
    for pairs, label in ((1_000, "1k"), (10_000, "10k"), (100_000, "100k")):
        m = measured.get(pairs)
        if m is None:
            continue
        us = m["gate_s"] / pairs * 1e6
        us_nd = m["gate_nodispatch_s"] / pairs * 1e6
        base = ""
        if "reference_s" in m:
            base = f"reference {m['reference_s'] / pairs * 1e6:.1f} us/pair"
        result.figure(
            f"gate_us_per_pair_{label}",
            us,
            "us/pair",
            baseline=base,
            target=f"<= {TARGET_US_PER_PAIR:g}",
            ok=us <= TARGET_US_PER_PAIR,
        )
        result.figure(f"gate_nodispatch_us_per_pair_{label}", us_nd, "us/pair", baseline="dispatch_work=False")
        if m["gate_layers_s"] is not None:
            result.figure(
                f"gate_us_per_pair_{label}_with_layers",
                m["gate_layers_s"] / pairs * 1e6,
                "us/pair",
                baseline=f"no layer config {us:.1f} us/pair",
                target=f"<= {TARGET_US_PER_PAIR:g}",
                ok=m["gate_layers_s"] / pairs * 1e6 <= TARGET_US_PER_PAIR,
            )
        if "reference_s" in m:
            speedup = m["reference_s"] / m["gate_s"]
            ok = speedup >= TARGET_SPEEDUP and m["decisions_equal"]
            result.figure(
                f"gate_speedup_vs_reference_{label}",
                speedup,
                "x",
                baseline=f"decisions equal: {m['decisions_equal']}",
                target=f">= {TARGET_SPEEDUP:g}x",
                ok=ok if label == "10k" else None,
            )
        if pairs <= 10_000:
            trips = m["trips"]
            result.figure(
                f"gate_roundtrips_{label}",
                trips.total,
                "round trips",
                baseline=f"reference {m['reference_trips'].total}" if "reference_trips" in m else "",
            )
        result.notes[f"gate_{label}"] = {
            "pairs": pairs,
            "load_seconds": m["load_s"],
            "gate_ms": round(m["gate_s"] * 1000, 2),
            "gate_nodispatch_ms": round(m["gate_nodispatch_s"] * 1000, 2),
            "reference_ms": round(m["reference_s"] * 1000, 1) if "reference_s" in m else None,
            "round_trips": m["trips"].describe(),
            "round_trips_nodispatch": m["trips_nodispatch"].describe(),
            "reference_round_trips": m["reference_trips"].describe() if "reference_trips" in m else None,
            "authorized": m["authorized"],
            "outcomes": m["outcomes"],
            "dispatched": m["dispatched"],
            "decisions_equal": m.get("decisions_equal"),
        }
    if 1_000 in measured and 10_000 in measured:
        same = measured[1_000]["trips"].total == measured[10_000]["trips"].total
        result.rows.append(
            Row(
                "gate_roundtrips_constant",
                str(same),
                "",
                f"1k={measured[1_000]['trips'].total} 10k={measured[10_000]['trips'].total}",
                "1k == 10k",
                "PASS" if same else "FAIL",
            )
        )
    result.notes["gate_setup"] = (
        "one book, N/2 scenes x 2 stages, all pending, one active command per stage over every scene,"
        " every pair capacity-deferred (no claim); 100k = one book of 50,000 scenes; median of repeated passes;"
        " round trips = Redis commands + pipelines + Postgres statements (pool check, BEGIN, COMMIT not counted)"
    )
    return result
