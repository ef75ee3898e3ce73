"""A job that fails, gives its pair back or loses its worker weighs its book, for the slot it frees, at the book's most
urgent pending pair's priority, as a job's commit does; with nothing pending the book does not wait again. *Why:*
weighed at the ended job's own priority, (a) a capped book's interactive scene waited behind the normal books after
its bulk job failed, and (b) a reader whose last interactive job failed was put back on the list at the interactive
rank with nothing left to run (the next slot handed to it for nothing, every book's share bound meanwhile)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from animastor_tasks.errors import GeneratorError, StoreUnavailable
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.flow.job import Job
from animastor_tasks.ports import GenerationRequest
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book, states
from .test_elastic_share import lane, run_control, running, waiting
from .test_job_troubles import _Generators, _Scripted
from .test_takeover_priority import _tick_takes_over

BOOKS = ("capped", "w", "n1", "n2", "n3")
ENDS = {
    "failed": GeneratorError("the scene is refused", retryable=False),
    "given_back": StoreUnavailable("redis", "redis://x", "a blip"),
}


def _first_running(rt: Wiring, book: str) -> Job:
    with rt.db.transaction() as conn:
        c, s, st, dispatch_id, token = conn.execute(
            "SELECT chapter_id, scene_id, stage, dispatch_id, fencing_token FROM asset_states"
            " WHERE book_id = %s AND state = 'generating' ORDER BY position LIMIT 1",
            (book,),
        ).fetchone()
    return Job(book, c, s, st, dispatch_id, token)


def _end_badly(rt: Wiring, book: str, end: str) -> None:
    """The first running job of `book` runs and ends `end` (its generator raises); then the control work it sent."""

    def raising(request: GenerationRequest, progress: Any) -> None:
        raise ENDS[end]

    ports = replace(rt.ports, generators=_Generators(_Scripted(raising)))
    result = run_job(ports, _first_running(rt, book), worker="test@local")
    assert result["outcome"] == end, result
    run_control(rt)


def _capped_book_beside_normal_waiters(rt: Wiring) -> None:
    """`capped` runs two bulk jobs at its cap (2), its reader's scene pending (refused by the cap, on no list); `w`
    and `n1` run; `n2` and `n3` (normal) wait for the lane."""
    lane(rt, lane_limit=4, book_quota=10, window=10, book_cap=2)
    rt.catalog.import_book(make_book("capped", chapters=1, scenes=4))
    for book in ("w", "n1", "n2", "n3"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "capped", ["audio"], [["ch1", "s1"], ["ch1", "s2"]], priority="bulk")
    regenerate_flow.regenerate(rt.ports, "w", ["audio"])
    regenerate_flow.regenerate(rt.ports, "capped", ["audio"], [["ch1", "s3"]], priority="interactive")
    assert states(rt, "capped")[("ch1", "s3", "audio")] == "pending"
    for book in ("n1", "n2", "n3"):
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    assert set(waiting(rt)) == {"n2", "n3"}


@pytest.mark.parametrize("end", sorted(ENDS))
def test_a_capped_reader_s_scene_takes_the_room_its_book_s_failed_bulk_job_frees(rt: Wiring, end: str) -> None:
    """Old code: the slot went to `n2`, the reader's scene `pending` behind the normal books."""
    _capped_book_beside_normal_waiters(rt)
    _end_badly(rt, "capped", end)
    assert states(rt, "capped")[("ch1", "s3", "audio")] == "generating"
    assert running(rt, *BOOKS) == {"capped": 2, "w": 1, "n1": 1}
    assert {"n2", "n3"} <= set(waiting(rt))


def test_a_capped_reader_s_scene_takes_the_room_its_book_s_dead_bulk_job_frees(rt: Wiring) -> None:
    """Old code: the takeover put the book back on the list at its dead bulk job's rank, behind the normal books."""
    _capped_book_beside_normal_waiters(rt)
    job = _first_running(rt, "capped")
    rt.redis.client.delete(rt.redis.keys.lease("capped", *job.pair), rt.redis.keys.queued(job.dispatch_id))
    _tick_takes_over(rt)
    assert states(rt, "capped")[("ch1", "s3", "audio")] == "generating"
    assert running(rt, *BOOKS) == {"capped": 2, "w": 1, "n1": 1}


def test_a_reader_whose_last_job_fails_does_not_wait_again_for_nothing(rt: Wiring) -> None:
    """Old code: `r` was back on the list at the interactive rank, nothing of it pending."""
    lane(rt, lane_limit=1, book_quota=10, window=10)
    for book in ("r", "r2", "n"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "r", ["audio"], priority="interactive")
    regenerate_flow.regenerate(rt.ports, "r2", ["audio"], priority="interactive")
    regenerate_flow.regenerate(rt.ports, "n", ["audio"])
    _end_badly(rt, "r", "failed")
    assert states(rt, "r") == {("ch1", "s1", "audio"): "failed"}
    assert running(rt, "r", "r2", "n") == {"r2": 1}
    assert list(waiting(rt)) == ["n"]
