"""What a job's commit tells of its book's work left on the stage (`Committed.pending`): the rank of its most urgent
pending pair that an authorizing command targets, read by the commit's own statement under the lane's lock, at a
cost that does not follow the size of the book. Real Postgres."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from animastor_tasks.adapters.postgres import jobs
from animastor_tasks.adapters.postgres.gate_reads import FEW_TARGETS
from animastor_tasks.domain.vocabulary import Priority, priority_rank
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.records import Committed

from .helpers import advertise, fake_artifact, make_book
from .test_read_costs import fetched, regenerated


def _commit_first(rt: Any, book: str) -> Committed | None:
    """The first generating pair of `book` (reading order) committed by its job."""
    with rt.db.read() as conn:
        row = conn.execute(
            "SELECT chapter_id, scene_id, stage, fencing_token, dispatch_id FROM asset_states"
            " WHERE book_id = %s AND state = 'generating' ORDER BY position LIMIT 1",
            (book,),
        ).fetchone()
    assert row is not None
    chapter, scene, stage, token, dispatch_id = row
    pair = (chapter, scene, stage)
    return rt.ports.jobs.commit_job(book, pair, token, dispatch_id, fake_artifact(scene), f"gpu.{stage}")


def _claimed(rt: Any, book: str, scene: str) -> None:
    """The pending pair of `scene` claimed (its job runs)."""
    with rt.db.transaction() as conn:
        conn.execute(
            "UPDATE asset_states SET state = 'generating' WHERE book_id = %s AND scene_id = %s AND state = 'pending'",
            (book, scene),
        )


def test_a_commit_tells_the_most_urgent_rank_left_pending_and_none_once_nothing_is(rt: Any) -> None:
    advertise(rt, "gpu.audio")
    rt.catalog.import_book(make_book("b", chapters=1, scenes=10))  # the lane's 8 slots: s9 and s10 stay pending
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", "s10"]], priority="interactive")  # lane full
    assert _commit_first(rt, "b") == Committed(priority_rank(Priority.INTERACTIVE))
    _claimed(rt, "b", "s10")
    assert _commit_first(rt, "b") == Committed(priority_rank(Priority.BULK))
    _claimed(rt, "b", "s9")
    assert _commit_first(rt, "b") == Committed(None)


def test_a_commit_sent_again_after_it_landed_tells_what_is_left_too(rt: Any) -> None:
    advertise(rt, "gpu.audio")
    rt.catalog.import_book(make_book("b", chapters=1, scenes=9))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    with rt.db.read() as conn:
        row = conn.execute(
            "SELECT chapter_id, scene_id, fencing_token, dispatch_id FROM asset_states"
            " WHERE book_id = 'b' AND state = 'generating' ORDER BY position LIMIT 1"
        ).fetchone()
    assert row is not None
    chapter, scene, token, dispatch_id = row
    artifact = fake_artifact(scene)
    first = rt.ports.jobs.commit_job("b", (chapter, scene, "audio"), token, dispatch_id, artifact, "gpu.audio")
    again = rt.ports.jobs.commit_job("b", (chapter, scene, "audio"), token, dispatch_id, artifact, "gpu.audio")
    assert first == again == Committed(priority_rank(Priority.NORMAL))


CHAPTER = [("ch3", f"s{n}") for n in range(1, 151)]  # more than FEW_TARGETS: found through the book's pairs


@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_the_read_of_what_is_left_does_not_walk_the_books_pending_pairs(rt: Any, plan: str) -> None:
    """A whole-book command keeps 4,000 pairs pending; a chapter command of 150 scenes beside it has none pending
    (its scenes run). Searching the book's pending pairs for a target of the chapter command read all of them."""
    regenerated(rt, "big", chapters=4, scenes=1000)
    regenerate_flow.regenerate(rt.ports, "big", ["audio"], [list(s) for s in CHAPTER], priority="interactive")
    with rt.db.transaction() as conn:
        conn.execute(
            "UPDATE asset_states SET state = 'generating' WHERE book_id = 'big' AND chapter_id = 'ch3'"
            " AND scene_id = ANY(%s)",
            ([scene for _, scene in CHAPTER],),
        )
    row, cost = pending_rank_read(rt, plan, "big")
    assert row == (priority_rank(Priority.NORMAL),)  # the chapter's scenes run: the whole book's are left
    # The whole-book command finds one of its own first; the chapter command looks at FEW_TARGETS pending pairs,
    # then at its own targets.
    assert cost <= FEW_TARGETS + len(CHAPTER) + 10, f"the read fetched {cost} asset rows"


def pending_rank_read(rt: Any, plan: str, book: str) -> tuple[Any, int]:
    """The commit's read of what `book` has left pending of its audio stage, and the asset rows it fetched, under
    `plan` (prepared at once: the plan the mode forces)."""
    params = {"book": book, "stage": "audio", **jobs._RANKS}
    with psycopg.connect(rt.settings.database_url, prepare_threshold=0) as conn:
        conn.execute(f"SET plan_cache_mode = {plan}")
        conn.execute(f"SELECT {jobs._PENDING_RANK}", params)
        before = fetched(conn)
        row = conn.execute(f"SELECT {jobs._PENDING_RANK}", params).fetchone()
        return row, fetched(conn) - before
