"""Gate pass cost per active pair, its round trips, and two references making the same decisions.

Setup per size: ONE book with N/2 scenes x 2 stages, every pair `pending`, one active
command per stage covering every scene, every pair deferred in the `capacity` bucket (so
the pass decides and skips, it never claims: this is the gate itself), every scene in
the active index. 100k pairs = one book of 50,000 scenes (the worst case for one pass:
the gate is per book, so 50 books x 1000 scenes costs 50 passes of the 1k figure).

Two references make the same decisions (`bench/gate_reference.py`): the faithful one does
what the reference runtime did (cancel flag, tombstone and layers once per book per pass, task
state once per scene, deferral once per pair: ~1.5 round trips per pair) and gives
`gate_speedup_vs_faithful_reference_{10k,100k}`; the per-pair one (5 round trips per pair)
keeps its old key `gate_speedup_vs_reference_{1k,10k}` for continuity, labelled as such.
Quick mode runs the faithful reference at 10k only and the per-pair one at 1k only.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from bench.common import BenchResult, Context, Row, analyze, make_runtime, median, pg_connect, reset_stores, timed
from bench.gate_reference import faithful_pass, per_pair_pass, same_decisions
from bench.round_trips import count_round_trips
from bench.seed import BookShape, activate, add_command, add_deferrals, load_books

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


def measure(rt: Any, pairs: int, reps: int, *, references: tuple[str, ...], warm: int, ctx: Context) -> dict[str, Any]:
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
        "authorized": report.authorized_count,
        "paged": len(report.authorized) != report.authorized_count,
        "outcomes": dict(report.outcomes),
        "dispatched": len(report.dispatched),
    }
    # A book past one page is passed page by page, which keeps no list of its decisions: the decisions are
    # compared on one untimed pass of the same code over a single page.
    decided = _one_page_pass(rt, pairs) if out["paged"] else report
    for name, reference in (("reference", per_pair_pass), ("faithful", faithful_pass)):
        if name not in references:
            continue
        ref_reps = max(1, reps // 3) if pairs <= 1000 else 1
        runs = []
        ref: dict[str, Any] = {}
        for _ in range(ref_reps):
            with count_round_trips(rt) as ref_trips:
                seconds, ref = timed(partial(reference, rt, BOOK))
            runs.append(seconds)
        out[f"{name}_s"] = median(runs)
        out[f"{name}_trips"] = ref_trips
        out[f"{name}_decisions_equal"] = same_decisions(ref, decided)
    return out


def _one_page_pass(rt: Any, pairs: int) -> Any:
    from animastor_tasks.flow import page
    from animastor_tasks.flow.gate import gate_pass

    size = page.PAGE
    page.PAGE = pairs + 1
    try:
        return gate_pass(rt.ports, BOOK)
    finally:
        page.PAGE = size


def _speedups(result: BenchResult, m: dict[str, Any], label: str) -> None:
    """The faithful reference's speedup (the target) and the per-pair one's (old key, for continuity)."""
    if "faithful_s" in m:
        speedup = m["faithful_s"] / m["gate_s"]
        equal = m["faithful_decisions_equal"]
        result.figure(
            f"gate_speedup_vs_faithful_reference_{label}",
            speedup,
            "x",
            baseline=f"faithful reference ({m['faithful_trips'].total / m['pairs']:.2f} trips/pair)"
            f" {m['faithful_s'] * 1000:.0f} ms; decisions equal: {equal}",
            target=f">= {TARGET_SPEEDUP:g}x",
            ok=speedup >= TARGET_SPEEDUP and equal,
        )
    if "reference_s" in m:
        speedup = m["reference_s"] / m["gate_s"]
        equal = m["reference_decisions_equal"]
        result.figure(
            f"gate_speedup_vs_reference_{label}",
            speedup,
            "x",
            baseline=f"per-pair reference (5 trips/pair, not the target's); decisions equal: {equal}",
        )


def run(ctx: Context) -> BenchResult:
    result = BenchResult()
    rt = make_runtime()
    try:
        # Quick mode skips the slow references (100k faithful ~40 s, 10k per-pair ~10 s on this machine).
        sizes = [
            (1_000, 15, ("reference",), 6),
            (10_000, 9, ("faithful",) if ctx.quick else ("reference", "faithful"), 1),
            (100_000, 1 if ctx.quick else 3, () if ctx.quick else ("faithful",), 1),
        ]
        measured = {
            m["pairs"]: m
            for m in (measure(rt, n, reps, references=refs, warm=warm, ctx=ctx) for n, reps, refs, warm in sizes)
        }
    finally:
        rt.close()
    for pairs, label in ((1_000, "1k"), (10_000, "10k"), (100_000, "100k")):
        m = measured.get(pairs)
        if m is None:
            continue
        us = m["gate_s"] / pairs * 1e6
        us_nd = m["gate_nodispatch_s"] / pairs * 1e6
        refs = [f"{n} {m[f'{n}_s'] / pairs * 1e6:.1f} us/pair" for n in ("faithful", "reference") if f"{n}_s" in m]
        result.figure(
            f"gate_us_per_pair_{label}",
            us,
            "us/pair",
            baseline="; ".join(refs).replace("reference ", "per-pair "),
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
        _speedups(result, m, label)
        if pairs <= 10_000:
            trips = m["trips"]
            refs = [f"{n} {m[f'{n}_trips'].total}" for n in ("faithful", "reference") if f"{n}_trips" in m]
            result.figure(
                f"gate_roundtrips_{label}",
                trips.total,
                "round trips",
                baseline="; ".join(refs).replace("reference ", "per-pair "),
            )
        result.notes[f"gate_{label}"] = {
            "pairs": pairs,
            "load_seconds": m["load_s"],
            "gate_ms": round(m["gate_s"] * 1000, 2),
            "gate_nodispatch_ms": round(m["gate_nodispatch_s"] * 1000, 2),
            "round_trips": m["trips"].describe(),
            "round_trips_nodispatch": m["trips_nodispatch"].describe(),
            "authorized": m["authorized"],
            "outcomes": m["outcomes"],
            "dispatched": m["dispatched"],
        }
        for name in ("reference", "faithful"):
            if f"{name}_s" in m:
                result.notes[f"gate_{label}"][f"{name}_ms"] = round(m[f"{name}_s"] * 1000, 1)
                result.notes[f"gate_{label}"][f"{name}_round_trips"] = m[f"{name}_trips"].describe()
                result.notes[f"gate_{label}"][f"{name}_decisions_equal"] = m[f"{name}_decisions_equal"]
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
        " round trips = Redis commands + pipelines + Postgres statements (pool check, BEGIN, COMMIT not counted);"
        " faithful reference = the reference runtime's reads (per book, per scene, per pair: ~1.5 trips/pair);"
        " per-pair reference (old key gate_speedup_vs_reference_*) = 5 trips/pair"
    )
    return result
