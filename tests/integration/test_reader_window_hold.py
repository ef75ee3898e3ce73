"""A reader's interactive image scene is handed the image lane's free slot; before its refill claims it, a bulk book's
pass (its regenerate, on the other control process) runs. The hold (`capacity.HANDED_HOLD_SECONDS`) kept the slot
for the reader only while its book was below its share, and the share's window counts the book's scenes in flight on
every stage: a book running 4 bulk audio scenes (window 4) was at it, though no book as urgent contested the image
lane, so the bulk book took the slot and the reader's scene waited a whole bulk job."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from animastor_tasks.flow import refill as refill_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.page import PassReport
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, end_job, make_book, states, use_settings
from .test_elastic_share import run_control


def two_lanes(rt: Wiring, audio: dict[str, int], image: dict[str, int]) -> None:
    """Audio and image stages with these limits and instant builtin jobs, a live consumer on each queue."""
    limits = {"audio": audio, "image": image}
    stages = tuple(
        replace(s, params={"steps": 1, "step_seconds": 0}, **limits[s.name]) for s in rt.settings.registry.stages
    )
    use_settings(rt, replace(rt.settings, registry=replace(rt.settings.registry, stages=stages)))
    advertise(rt, "gpu.audio", "gpu.image")


def running(rt: Wiring, stage: str, *books: str) -> list[tuple[str, str]]:
    return [
        (book, scene)
        for book in books
        for (_, scene, st), state in states(rt, book).items()
        if st == stage and state == "generating"
    ]


@pytest.mark.parametrize("reader_runs_audio", [False, True], ids=["reader-idle", "reader-at-its-window"])
def test_a_bulk_pass_does_not_take_the_slot_handed_to_a_reader_at_its_window(
    rt: Wiring, monkeypatch: pytest.MonkeyPatch, reader_runs_audio: bool
) -> None:
    two_lanes(rt, {"lane_limit": 4, "book_quota": 4, "window": 4}, {"lane_limit": 1, "book_quota": 4, "window": 4})
    for book, scenes in (("reader", 8), ("p", 4), ("q", 4)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "p", ["image"], priority="bulk")  # the image lane's one slot
    if reader_runs_audio:
        regenerate_flow.regenerate(rt.ports, "reader", ["audio"], priority="bulk")
        assert len(running(rt, "audio", "reader")) == 4  # its window is full
    regenerate_flow.regenerate(rt.ports, "reader", ["image"], [["ch1", "s7"]], priority="interactive")
    assert running(rt, "image", "p", "reader") == [("p", "s1")]

    held: list[tuple[Any, ...]] = []
    real = refill_flow.refill
    with monkeypatch.context() as on_its_way:
        on_its_way.setattr(refill_flow, "refill", lambda *a, **k: held.append((a, k)) or PassReport(a[1]))
        end_job(rt, "p", "s1", "image")  # the slot is handed to the reader, its refill on its way
    assert [a[1] for a, _ in held] == ["reader"]
    regenerate_flow.regenerate(rt.ports, "q", ["image"], priority="bulk")  # meanwhile, on the other control process
    assert running(rt, "image", "q") == []
    for args, kwargs in held:
        real(*args, **kwargs)
    run_control(rt)
    assert running(rt, "image", "p", "q", "reader") == [("reader", "s7")]
