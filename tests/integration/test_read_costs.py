"""What the reads on a job's path cost the server, counted by the server itself. Real Postgres.

- A refill's candidate read costs what the free slots need, not what the book holds: the rows of
  `asset_states` it fetches (`pg_stat_xact_user_tables`, within the read's own transaction), under the
  plan a fresh statement gets and under the generic plan a prepared one settles on.
- A regenerate of a few scenes reads those scenes, not the book: its command context (the book, the request id,
  the named scenes) fetches about as many `scenes` rows as it names. It had read every scene of the book
  (19 ms of a one-scene regenerate in a book of 100,000 scenes, 0.9 ms in a small one).
- The statements of a job's path settle on a generic plan, so the server stops planning them. psycopg
  prepares a statement at its fifth run; the server plans the next five for their values, then keeps a
  generic plan when it costs about as much. A state passed as a parameter cannot match a partial index
  in a generic plan, so those statements were planned afresh on every run (0.1-0.8 ms each); counted
  here on a pool of one connection (`pg_prepared_statements`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import psycopg
import pytest

from animastor_tasks.adapters.postgres.assets import AssetStore
from animastor_tasks.adapters.postgres.catalog import Catalog
from animastor_tasks.adapters.postgres.commands import CommandStore
from animastor_tasks.adapters.postgres.gate_reads import GateReads
from animastor_tasks.adapters.postgres.jobs import JobStore
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.domain.book import book_to_dict, parse_book
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import advertise, make_book

LIMIT = 16
RUNS = 12


def regenerated(rt: Any, book: str, *, chapters: int, scenes: int) -> None:
    """A book imported and regenerated on its audio stage, a consumer advertised: its first pairs claimed."""
    rt.catalog.import_book(make_book(book, chapters=chapters, scenes=scenes))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, book, ["audio"])


class _InOneTransaction:
    """Stands in for the pool: every read runs on one connection, in one transaction the test can inspect."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    @contextmanager
    def read(self) -> Iterator[psycopg.Connection]:
        yield self.conn


def fetched(conn: psycopg.Connection, table: str = "asset_states") -> int:
    row = conn.execute(
        "SELECT coalesce(sum(seq_tup_read), 0) + coalesce(sum(idx_tup_fetch), 0)"
        " FROM pg_stat_xact_user_tables WHERE relname = %s",
        (table,),
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_the_candidate_read_fetches_about_the_limit_from_a_book_of_thousands_of_pending_pairs(
    rt: Any, plan: str
) -> None:
    regenerated(rt, "big", chapters=4, scenes=500)
    with rt.db.transaction() as conn:  # the first chapter done, as its jobs would leave it
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'big' AND chapter_id = 'ch1'")
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        reads = GateReads(cast(Database, _InOneTransaction(conn)))
        for _ in range(3):  # prepared from the first run (threshold 0): the plan the mode forces
            reads.gate_candidates("big", ["audio"], LIMIT)
        before = fetched(conn)
        rows = reads.gate_candidates("big", ["audio"], LIMIT)
        cost = fetched(conn) - before
    assert rows is not None
    # The candidates are the first pending pairs in reading order: chapter 2 from its start.
    assert [i.pair for i in rows.in_flight] == [("ch2", f"s{n}", "audio") for n in range(1, LIMIT + 1)]
    # 1,500 pairs are pending; the read fetches the limit's worth, with room for the skipped ones.
    assert cost <= 4 * LIMIT, f"fetched {cost} asset rows for {LIMIT} candidates"


@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_the_command_context_of_a_few_scenes_fetches_those_scenes_not_the_book(rt: Any, plan: str) -> None:
    rt.catalog.import_book(make_book("long", chapters=4, scenes=500))
    named = [("ch3", "s7"), ("ch1", "s2"), ("ch3", "s7")]  # out of reading order, one named twice
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        catalog = Catalog(cast(Database, _InOneTransaction(conn)), rt.settings.registry)
        for _ in range(3):  # prepared from the first run (threshold 0): the plan the mode forces
            catalog.command_context("long", named, "00000000-0000-4000-8000-000000000001")
        before = fetched(conn, "scenes")
        context = catalog.command_context("long", named, "00000000-0000-4000-8000-000000000001")
        cost = fetched(conn, "scenes") - before
    assert context.exists and context.replay_of == []
    assert context.scenes == [("ch1", "s2"), ("ch3", "s7")]  # each once, in reading order
    assert cost <= 4, f"fetched {cost} scene rows for {len(named)} named scenes of 2,000"
    whole = Catalog(rt.db, rt.settings.registry).command_context("long", None, "00000000-0000-4000-8000-000000000002")
    assert len(whole.scenes) == 2000 and whole.scenes[:2] == [("ch1", "s1"), ("ch1", "s2")]
    assert Catalog(rt.db, rt.settings.registry).command_context("none", named, str(uuid.uuid4())).exists is False


def misplaced(rt: Any, book: str) -> int:
    """Pairs whose position is not their scene's."""
    with rt.db.read() as conn:
        row = conn.execute(
            "SELECT count(*) FROM asset_states a JOIN scenes s ON s.book_id = a.book_id"
            " AND s.chapter_id = a.chapter_id AND s.scene_id = a.scene_id"
            " WHERE a.book_id = %s AND a.position IS DISTINCT FROM s.position",
            (book,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_reimport_that_reorders_the_scenes_reorders_the_candidates(rt: Any) -> None:
    book = make_book("moved", chapters=1, scenes=6)
    rt.catalog.import_book(book)
    raw = book_to_dict(book)
    raw["chapters"][0]["scenes"].reverse()
    reordered = parse_book(raw)
    rt.catalog.import_book(reordered)
    assert misplaced(rt, "moved") == 0
    with rt.db.transaction() as conn:  # a stage added after the import: its rows come with the command
        conn.execute("DELETE FROM asset_states WHERE book_id = 'moved' AND stage = 'audio'")
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "moved", ["audio"])
    assert misplaced(rt, "moved") == 0
    rows = rt.ports.assets.gate_candidates("moved", ["audio"], LIMIT)
    assert rows is not None
    pending = [i.pair[1] for i in rows.in_flight]
    assert pending == sorted(pending, key=lambda scene: -int(scene[1:]))  # reading order: s6 first now


@pytest.fixture
def one_connection(rt: Any) -> Any:
    db = Database(rt.settings.database_url, max_size=1)
    yield db
    db.close()


def plans(db: Database, prefix: str) -> tuple[int, int]:
    """(generic, custom) plans the connection made for the prepared statement that starts with `prefix`."""
    with db.read() as conn:
        rows = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
            (prefix + "%",),
        ).fetchall()
    assert len(rows) == 1, rows
    return int(rows[0][0]), int(rows[0][1])


def run(times: int, call: Callable[[], object]) -> None:
    for _ in range(times):
        call()


def test_the_refill_read_the_claim_counts_and_the_job_start_read_run_on_generic_plans(
    rt: Any, one_connection: Database
) -> None:
    regenerated(rt, "b1", chapters=2, scenes=40)
    assets, jobs = AssetStore(one_connection), JobStore(one_connection)

    def claim_counts() -> None:
        with assets.claiming("b1", {"audio": "gpu.audio"}, {"audio": {"b2": 1}}):
            pass

    def start_read() -> None:
        with jobs.starting("b1", ("ch1", "s1", "audio")) as start:
            assert start.row is not None

    run(RUNS, lambda: assets.gate_candidates("b1", ["audio"], 16))
    run(RUNS, claim_counts)
    run(RUNS, start_read)
    counted = {
        p: plans(one_connection, p) for p in ("WITH cmd AS", "SELECT stage, NULL", "SELECT a.state, a.fencing_token")
    }
    # Prepared after 5 runs, planned for its values 5 times, then generic: nothing planned since.
    assert {p: (generic >= RUNS - 10 and custom <= 5) for p, (generic, custom) in counted.items()} == dict.fromkeys(
        counted, True
    ), f"(generic, custom) plans: {counted}"


class _Recorded:
    """A connection that remembers the last statement run through it (to EXPLAIN it as it was sent)."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        self.last: tuple[str, Any] = ("", None)

    def execute(self, sql: str, params: Any = None) -> Any:
        self.last = (sql, params)
        return self.conn.execute(sql, params)


def join_filtered(plan: Any) -> int:
    """Rows a plan's joins read and threw away, over every node of an `EXPLAIN (ANALYZE, FORMAT JSON)`."""
    own = int(plan.get("Rows Removed by Join Filter", 0)) * int(plan.get("Actual Loops", 1))
    return own + sum(join_filtered(child) for child in plan.get("Plans", []))


def test_the_gate_rows_of_a_book_the_statistics_think_idle_cost_what_its_pairs_do(rt: Any) -> None:
    """Statistics taken while a book was idle say it has no pair in flight; a whole-book regenerate (too few
    rows of a big table to set off autovacuum's analyze) and a few one-scene ones later, the generic plan the
    pass's statement settles on must still not read the commanded targets once per in-flight pair: that
    plan took 5.7 s per pass of a book of 5,000 pending pairs (12.5 million rows thrown away)."""
    rt.catalog.import_book(make_book("idle", chapters=2, scenes=200))
    with rt.db.transaction() as conn:
        conn.execute("ANALYZE asset_states; ANALYZE commands; ANALYZE command_targets; ANALYZE scenes")
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "idle", ["audio"])
    for n in range(1, 6):
        regenerate_flow.regenerate(rt.ports, "idle", ["audio"], [["ch2", f"s{n}"]], priority="interactive")
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        recorded = _Recorded(conn)
        rows = GateReads(cast(Database, _InOneTransaction(cast(psycopg.Connection, recorded)))).gate_rows_many(
            ["idle"], limit=1000
        )
        sql, params = recorded.last
        explained = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchone()
    assert rows is not None and rows["idle"] is not None
    in_flight = rows["idle"].in_flight
    assert len(in_flight) == 400 and all(i.commanded for i in in_flight)
    assert {i.pair for i in in_flight if i.rank == 0} == {("ch2", f"s{n}", "audio") for n in range(1, 6)}
    assert explained is not None
    thrown = join_filtered(explained[0][0]["Plan"])
    assert thrown <= len(in_flight), f"the plan threw away {thrown} joined rows for {len(in_flight)} pairs"


class _TransactionInOne(_InOneTransaction):
    """Stands in for the pool's transactions too: the test's one transaction (rolled back by the test)."""

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        yield self.conn


def test_a_jobs_commit_settles_the_commands_of_its_pair_not_every_command_of_the_book(rt: Any) -> None:
    """A book whose whole-book command runs beside thirty one-scene ones: a job's commit (under the lane's
    lock) looked for an in-flight target of every active command of the book, reading the book's in-flight
    pairs once per command (67 ms per commit at 5,000 pairs and 21 commands). Only the commands that target
    the committed pair can settle by its commit."""
    regenerated(rt, "busy", chapters=2, scenes=200)
    for n in range(1, 31):
        regenerate_flow.regenerate(rt.ports, "busy", ["audio"], [["ch2", f"s{n}"]], priority="interactive")
    with rt.db.read() as conn:
        row = conn.execute(
            "SELECT chapter_id, scene_id, fencing_token, dispatch_id FROM asset_states"
            " WHERE book_id = 'busy' AND state = 'generating' ORDER BY chapter_id, scene_id LIMIT 1"
        ).fetchone()
    assert row is not None
    chapter, scene, token, dispatch_id = row
    artifact = {"sha256": "0" * 64, "size": 1, "media_type": "audio/wav", "generator": "test", "duration_ms": 1}
    with psycopg.connect(rt.settings.database_url) as conn:
        jobs = JobStore(cast(Database, _TransactionInOne(conn)))
        before = fetched(conn)
        committed = jobs.commit_job(
            "busy", (chapter, scene, "audio"), token, dispatch_id, {**artifact, "path": "x"}, "gpu.audio"
        )
        cost = fetched(conn) - before
        conn.rollback()
    assert committed
    # 400 pairs in flight, 31 active commands: a look per command at the in-flight pairs read about 12,400.
    assert cost <= 3 * 400, f"a commit read {cost} asset rows"


@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_the_candidate_read_beside_one_scene_commands_whose_scenes_run_reads_no_more(rt: Any, plan: str) -> None:
    """A one-scene command whose scene runs has no pending target: walking the book's pending pairs in reading
    order for one of its own, it read every one of them, at every refill of the book (383 ms per refill at
    5,000 pending pairs and 20 such commands). A command of few targets reads its targets instead."""
    regenerated(rt, "wide", chapters=4, scenes=500)
    scenes = [("ch4", f"s{n}") for n in range(491, 501)]
    for chapter, scene in scenes:
        regenerate_flow.regenerate(rt.ports, "wide", ["audio"], [[chapter, scene]], priority="interactive")
    with rt.db.transaction() as conn:  # their jobs run, as the slots the interactive pass takes would
        conn.execute(
            "UPDATE asset_states SET state = 'generating' WHERE book_id = 'wide' AND stage = 'audio'"
            " AND chapter_id = 'ch4' AND scene_id = ANY(%s)",
            ([s for _, s in scenes],),
        )
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        reads = GateReads(cast(Database, _InOneTransaction(conn)))
        for _ in range(3):
            reads.gate_candidates("wide", ["audio"], LIMIT)
        before = fetched(conn)
        rows = reads.gate_candidates("wide", ["audio"], LIMIT)
        cost = fetched(conn) - before
    assert rows is not None
    assert len(rows.in_flight) == LIMIT and all(i.state == "pending" for i in rows.in_flight)
    # About 1,990 pairs pending; eleven commands: the whole-book one reads about the limit, each other its target.
    assert cost <= 4 * LIMIT + 2 * len(scenes), f"fetched {cost} asset rows for {LIMIT} candidates"


def test_the_pools_connections_compile_no_statement(rt: Any) -> None:
    """JIT off: a refill's read beside twenty one-scene commands was estimated past `jit_above_cost` and spent
    40 ms compiling itself to run for 2 ms."""
    with rt.db.read() as conn:
        row = conn.execute("SHOW jit").fetchone()
    assert row is not None and row[0] == "off"


@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_the_commands_listing_reads_the_targets_of_the_commands_it_lists_not_every_command_ever(
    rt: Any, plan: str
) -> None:
    """`animastor-tasks commands` read every command target ever kept (a sequential scan of `command_targets`
    hashed against every pair: 3.4 s at 8.9 million targets) to list the newest 200 commands."""
    regenerated(rt, "old", chapters=4, scenes=250)
    for _ in range(4):  # history: ended whole-book commands of another book, 1,000 targets each
        regenerate_flow.regenerate(rt.ports, "old", ["audio"])
    with rt.db.transaction() as conn:  # and 2,000 ended one-scene ones, so the statistics say what a farm's do
        conn.execute(
            "WITH made AS (INSERT INTO commands SELECT (jsonb_populate_record(c, jsonb_build_object('command_id',"
            " gen_random_uuid(), 'request_id', gen_random_uuid(), 'status', 'completed', 'created_at',"
            " now() - interval '1 day'))).* FROM commands c, generate_series(1, 2000) WHERE c.command_id ="
            " (SELECT command_id FROM commands WHERE book_id = 'old' LIMIT 1) RETURNING command_id)"
            " INSERT INTO command_targets SELECT command_id, 'old', 'ch1', 's1', 'audio' FROM made"
        )
    rt.catalog.import_book(make_book("new", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "new", ["audio"])
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        commands = CommandStore(cast(Database, _InOneTransaction(conn)))
        for _ in range(3):
            commands.commands(limit=1)
        before = fetched(conn, "command_targets")
        [listed] = commands.commands(limit=1)
        cost = fetched(conn, "command_targets") - before
    assert listed.book_id == "new" and listed.targets == 3
    assert cost <= 10, f"fetched {cost} command targets to list a command of 3"
