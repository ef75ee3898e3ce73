"""A gate pass's read of one book costs what that book holds, not what the farm holds. Real Postgres.

The statement joins the book's in-flight pairs to their scenes and to the targets of active commands. The
server does not carry the list of books asked for across those joins: a hash join hashed every scene and every
target of every book, so one book's pass cost as much as the farm (33 ms per book of 1,000 pairs beside 99
others), and the beat's reconcile, which passes each book with work, grew with the square of the books.
Counted by the server itself (`pg_stat_xact_user_tables`), under a fresh plan and the generic plan a prepared
statement settles on, with statistics that have seen the whole farm.
"""

from __future__ import annotations

from typing import Any, cast

import pytest

from animastor_tasks.adapters.postgres.gate_reads import GateReads
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import advertise, make_book
from .test_one_command_statistics import PLANS, _counted, _statistics_in_one_transaction
from .test_read_costs import RUNS, _InOneTransaction, one_connection, plans

__all__ = ["one_connection"]  # a fixture: used by name

BOOKS = 30
CHAPTERS, SCENES = 2, 100  # per book: 200 scenes, their audio pairs in flight under one command


@pytest.mark.parametrize("plan", PLANS)
def test_the_gate_rows_of_one_book_of_a_busy_farm_read_that_books_scenes_and_targets(rt: Any, plan: str) -> None:
    advertise(rt, "gpu.audio")
    for n in range(BOOKS):
        rt.catalog.import_book(make_book(f"farm{n}", chapters=CHAPTERS, scenes=SCENES))
        regenerate_flow.regenerate(rt.ports, f"farm{n}", ["audio"])
    pairs = CHAPTERS * SCENES
    tables = ("scenes", "command_targets")
    with _statistics_in_one_transaction(rt, plan, "asset_states, commands, command_targets, scenes, books") as conn:
        reads = GateReads(cast(Database, _InOneTransaction(conn)))
        cost = _counted(conn, lambda: reads.gate_rows_many(["farm7"], limit=1000), tables)
        rows = reads.gate_rows_many(["farm7"], limit=1000)
    assert rows is not None and (book := rows["farm7"]) is not None
    assert len(book.in_flight) == pairs and all(i.commanded for i in book.in_flight)
    # Each table: the book's own rows, a lookup per pair at most; the farm holds 30 times as many.
    for table, fetched in zip(tables, cost, strict=True):
        assert fetched <= 2 * pairs, f"fetched {fetched} rows of {table} for a book of {pairs} pairs"


def test_the_gate_rows_of_one_book_run_on_a_generic_plan(rt: Any, one_connection: Database) -> None:
    """A pass of one book (a regenerate's, a job's refill when nothing of its book is pending) named its book in
    a list: the server planned the statement afresh on every run, 0.6 ms of a pass of a book with one pair in
    flight. Counted on a pool of one connection (`pg_prepared_statements`)."""
    advertise(rt, "gpu.audio")
    rt.catalog.import_book(make_book("one", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "one", ["audio"], [["ch1", "s1"]])
    reads = GateReads(one_connection)
    for _ in range(RUNS):
        rows = reads.gate_rows_many(["one"], limit=1000)
        assert rows is not None and (book := rows["one"]) is not None and len(book.in_flight) == 1
    generic, custom = plans(one_connection, "WITH g AS")
    # Prepared after 5 runs, planned for its values 5 times, then generic: nothing planned since.
    assert generic >= RUNS - 10 and custom <= 5, f"{generic} generic, {custom} custom plans"
