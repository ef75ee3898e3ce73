"""A caller's refused command is its error, not the worker's: logged at INFO without a traceback. The tasks only this
runtime sends (refill, gate_batch, generate.<stage>) refuse kwargs of another type than the
runtime sends, naming the field, before anything is read or written; the message of the right shape that follows
runs as before. *Why:* a hand-written one failed deep inside (`operator does not exist: text = smallint`,
`unhashable type: 'list'`), and a string of book ids was passed as a book per character."""

from __future__ import annotations

import re
from typing import Any

import pytest

from animastor_tasks.errors import InvalidCommand
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker import tasks
from animastor_tasks.worker.app import app
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book, states
from .test_elastic_share import lane
from .test_generate import dispatched_jobs
from .test_job_troubles import _one_scene


@pytest.mark.parametrize(
    ("kwargs", "refusal"),
    [
        ({"book_id": 5}, r"animastor.refill: book_id must be str, got 5$"),
        ({"book_id": "x", "lane": ["gpu.audio"]}, r"lane must be str or null, got \['gpu.audio'\]"),
        ({"book_id": "x", "lane": "gpu.audio", "slots": "2"}, r"slots must be int or null, got '2'"),
        ({"book_id": "x", "lane": "gpu.audio", "slots": True}, r"slots must be int or null, got True"),
        ({"book_id": "x", "freed": 1}, r"freed must be str or null, got 1"),
        ({"book_id": "x\x00"}, r"book_id"),
        # Past Redis's integers: it failed in a Lua script, reported as 'redis unavailable' (Redis was fine).
        ({"book_id": "x", "lane": "gpu.audio", "slots": 10**30}, r"slots must be from 1 to 1,000,000,000, got 10+$"),
        ({"book_id": "x", "lane": "gpu.audio", "slots": 0}, r"slots must be from 1 to 1,000,000,000, got 0$"),
    ],
)
def test_a_refill_of_another_shape_is_refused_and_changes_nothing(rt: Wiring, kwargs: Any, refusal: str) -> None:
    lane(rt, lane_limit=1)
    rt.catalog.import_book(make_book("x", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "x", ["audio"])  # one scene runs, one waits for the slot
    before = states(rt, "x")
    with pytest.raises(InvalidCommand, match=refusal):
        tasks.refill_task.run(**kwargs)
    assert states(rt, "x") == before


@pytest.mark.parametrize(
    ("book_ids", "refusal"),
    [
        ("x", r"book_ids must be list, got 'x'"),
        (["x", 7], r"book_ids\[1\] must be str, got 7"),
        (["x", "y\x00"], r"book_ids\[1\]"),
    ],
)
def test_a_gate_batch_of_another_shape_is_refused(rt: Wiring, book_ids: Any, refusal: str) -> None:
    rt.catalog.import_book(make_book("x", chapters=1, scenes=1))
    with pytest.raises(InvalidCommand, match=refusal):
        tasks.gate_batch.run(book_ids)
    assert tasks.gate_batch.run(["x"]) == 1


def test_a_gate_batch_passes_a_book_named_twice_once_and_refuses_more_books_than_the_tick_could_send(
    rt: Wiring,
) -> None:
    """100,000 ids (one book repeated) held a control process 40 s, writing a warning line for each."""
    rt.catalog.import_book(make_book("x", chapters=1, scenes=1))
    with pytest.raises(InvalidCommand, match=r"at most 1000 book ids, got 1,001$"):
        tasks.gate_batch.run(["x"] * (tasks.MOST_BATCHED + 1))
    assert tasks.gate_batch.run(["x"] * tasks.MOST_BATCHED) == 1


@pytest.mark.parametrize(
    ("task", "kwargs", "refusal"),
    [
        ("animastor.refill", {"lane": "gpu.audio"}, r"animastor.refill: missing a required argument: 'book_id'"),
        ("animastor.gate_batch", {}, r"animastor.gate_batch: missing a required argument: 'book_ids'"),
        ("animastor.generate.audio", {"book_id": "x"}, r"animastor.generate.audio: missing a required argument"),
    ],
)
def test_a_runtime_task_missing_an_argument_is_an_invalid_command(
    rt: Wiring, task: str, kwargs: Any, refusal: str
) -> None:
    """It was Python's bare TypeError."""
    result = app.tasks[task].apply(kwargs=kwargs)
    assert isinstance(result.result, InvalidCommand), result.result
    assert result.result.args and re.match(refusal, str(result.result)), str(result.result)


@pytest.mark.parametrize(
    ("field", "value", "refusal"),
    [
        ("scene_id", 5, r"scene_id must be str, got 5"),
        ("fencing_token", "1", r"fencing_token must be int, got '1'"),
        ("fencing_token", True, r"fencing_token must be int, got True"),
        ("dispatch_id", None, r"dispatch_id must be str, got None"),
        ("stage", "image", r"animastor.generate.audio: stage must be 'audio', got 'image'"),
        ("stage", "video", r"animastor.generate.audio: stage must be 'audio', got 'video'"),
    ],
)
def test_a_job_of_another_shape_is_refused_and_its_own_runs(
    rt: Wiring, tmp_path, field: str, value: Any, refusal: str
) -> None:
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    task = app.tasks[rt.settings.registry.get("audio").task_name]
    fields = {
        k: getattr(job, k) for k in ("book_id", "chapter_id", "scene_id", "stage", "dispatch_id", "fencing_token")
    }
    with pytest.raises(InvalidCommand, match=refusal):
        task.run(**{**fields, field: value})
    assert states(rt, "b")[("ch1", "s1", "audio")] == "generating"
    assert task.run(**fields)["outcome"] == "ready"


@pytest.mark.parametrize(
    ("task", "kwargs"),
    [
        ("animastor.regenerate", {"book_id": "x", "stages": ["video"]}),
        ("animastor.cancel", {"book_id": "no such book"}),
        ("animastor.gate", {"book_id": "x", "lane": 5}),
    ],
)
def test_a_callers_refused_command_is_no_worker_error(rt: Wiring, caplog, task: str, kwargs: Any) -> None:
    """Logged as ERROR with a full traceback: any caller could fill the worker's error log."""
    rt.catalog.import_book(make_book("x", chapters=1, scenes=1))
    caplog.set_level("INFO", logger="celery.app.trace")
    result = app.tasks[task].apply(kwargs=kwargs)
    assert isinstance(result.result, InvalidCommand)
    [record] = [r for r in caplog.records if r.name == "celery.app.trace"]
    assert record.levelname == "INFO" and "raised expected: InvalidCommand" in record.getMessage()
    assert record.exc_info is None
