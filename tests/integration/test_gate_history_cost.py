"""What a gate pass's read of a book costs the server as the book's command history grows. Real Postgres.

Commands are kept once they end (`ANIMASTOR_COMMAND_RETENTION_DAYS` unset), and a whole-book one keeps a target per
scene. The read looked up every target a pair ever had (an index on the pair, or a hash of the book's targets) and
each one's command, only to drop the ended ones: 34 ms per pass of a book of 2,000 in-flight pairs at 6 targets per
pair, 65 ms at 31 (11 ms at either now). Counted here in buffers (`EXPLAIN (ANALYZE, BUFFERS)` of the statement as
sent), under a fresh plan and a generic one, on statistics taken before the history came, as a farm's mostly are.
"""

from __future__ import annotations

import uuid
from typing import Any, cast

import psycopg
import pytest

from animastor_tasks.adapters.postgres.gate_reads import GateReads
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import make_book
from .test_read_costs import _InOneTransaction, _Recorded, regenerated

ENDED = 25


def _ended_whole_book_commands(conn: psycopg.Connection, book: str, count: int) -> None:
    """`count` whole-book commands of each stage, over for good, as kept history leaves them."""
    for n in range(count):
        for stage in ("audio", "image"):
            command = str(uuid.uuid4())
            conn.execute(
                "INSERT INTO commands (command_id, book_id, stage, status, request_id, target_count, created_at,"
                " updated_at) SELECT %s, %s, %s, 'completed', %s, count(*), now() - make_interval(days => %s),"
                " now() - make_interval(days => %s) FROM scenes WHERE book_id = %s",
                (command, book, stage, str(uuid.uuid4()), 100 - n, 99 - n, book),
            )
            conn.execute(
                "INSERT INTO command_targets (command_id, book_id, chapter_id, scene_id, stage)"
                " SELECT %s, book_id, chapter_id, scene_id, %s FROM scenes WHERE book_id = %s",
                (command, stage, book),
            )


def _read(conn: psycopg.Connection, book: str) -> tuple[Any, int]:
    """The book's gate rows read on `conn`, and the buffers the same statement touches when explained."""
    recorded = _Recorded(conn)
    rows = GateReads(cast(Database, _InOneTransaction(cast(psycopg.Connection, recorded)))).gate_rows(book)
    sql, params = recorded.last
    explained = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
    assert explained is not None
    top = explained[0][0]["Plan"]
    return rows, int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))


@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_the_gate_read_of_a_book_costs_the_same_beside_25_ended_whole_book_commands(rt: Any, plan: str) -> None:
    rt.catalog.import_book(make_book("other", chapters=2, scenes=500))
    regenerated(rt, "kept", chapters=2, scenes=500)
    regenerate_flow.regenerate(rt.ports, "kept", ["audio"], [["ch2", "s7"]], priority="interactive")
    # One transaction, rolled back: the history and the statistics are the test's own, and no later test plans
    # on them. The statistics are taken before the book's history comes, as a farm's mostly are.
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        _ended_whole_book_commands(conn, "other", ENDED)  # the farm's history: the indexes as deep as they get
        conn.execute("ANALYZE commands, command_targets, asset_states, scenes")
        fresh, cost = _read(conn, "kept")
        _ended_whole_book_commands(conn, "kept", ENDED)
        kept, cost_kept = _read(conn, "kept")
        conn.rollback()
    assert fresh is not None and kept is not None
    assert kept.commanded == fresh.commanded and sorted(kept.in_flight) == sorted(fresh.in_flight)  # ended: no say
    assert len(kept.in_flight) == 1000 and len(kept.commanded) == 1000
    assert {i.pair for i in kept.in_flight if i.rank == 0} == {("ch2", "s7", "audio")}
    # 26 targets a pair (the whole-book command and 25 ended ones of its stage), s7 one more.
    assert cost_kept <= 1.5 * cost, f"{cost_kept} buffers beside {2 * ENDED} ended commands, {cost} without"


def _places(rt: Any, book: str) -> dict[tuple[str, str, str], tuple[int, float]]:
    """Each commanded pair's place from its active commands, by the plain definition: rank, then oldest."""
    with rt.db.read() as conn:
        rows = conn.execute(
            "SELECT t.chapter_id, t.scene_id, t.stage, min(ARRAY[array_position(%s::text[], c.priority)::float8 - 1,"
            " extract(epoch FROM c.created_at)::float8]) FROM command_targets t JOIN commands c USING (command_id)"
            " WHERE c.book_id = %s AND c.status = 'active' GROUP BY 1, 2, 3",
            (["interactive", "normal", "bulk"], book),
        ).fetchall()
    return {(chapter, scene, stage): (int(place[0]), place[1]) for chapter, scene, stage, place in rows}


@pytest.mark.parametrize("chapters", [3, 6])  # beside the whole-book one: 4 of many targets (probed), 7 (too many)
def test_the_gate_read_places_each_pair_by_its_active_commands(rt: Any, chapters: int) -> None:
    """Whatever way a pair is looked up (by each command of many targets, in the set of the few commands' targets,
    on the pair when its stage has more than four commands of many targets), its place is its commands'."""
    regenerated(rt, "mixed", chapters=2, scenes=300)  # the whole-book command: normal
    for n in range(chapters):  # overlapping runs of 120 scenes, bulk and interactive in turn
        scenes = [["ch1", f"s{k}"] for k in range(30 * n + 1, 30 * n + 121)]
        priority = "interactive" if n % 2 else "bulk"
        regenerate_flow.regenerate(rt.ports, "mixed", ["audio"], scenes, force=False, priority=priority)
    for scene, priority in (("s2", "interactive"), ("s250", "bulk"), ("s290", "interactive")):
        regenerate_flow.regenerate(rt.ports, "mixed", ["audio"], [["ch2", scene]], force=False, priority=priority)
    rows = GateReads(rt.db).gate_rows("mixed")
    assert rows is not None and len(rows.in_flight) == 600
    expected = _places(rt, "mixed")
    found = {i.pair: (i.rank, i.since) for i in rows.in_flight if i.commanded}
    assert found == {pair: place for pair, place in expected.items() if pair in found}
    assert rows.commanded == frozenset(found) == frozenset(expected)
    assert {i.pair for i in rows.in_flight if i.rank == 0} >= {("ch2", "s2", "audio"), ("ch2", "s290", "audio")}
