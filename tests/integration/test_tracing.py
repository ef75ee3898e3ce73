"""Tracing (the otel extra): one trace follows a command from regenerate through the gate pass to each GPU job.

Why in-process: a Celery worker thread (`celery.contrib.testing.worker`, solo pool) runs the real tasks on
the real broker and stores, and the spans land in an in-memory exporter we can read at once; worker
subprocesses would add seconds and a file format to parse for the same propagation code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra (also in dev) is not installed")
pytest.importorskip("opentelemetry.instrumentation.celery", reason="the otel extra is not installed")

from celery.contrib.testing.worker import start_worker
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.worker import tracing, wiring
from tests.support import wait_for

from .helpers import advertise, make_book


@pytest.fixture
def traced(rt: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Any, InMemorySpanExporter]]:
    """This process traced into memory, and a worker thread consuming the control and audio queues."""
    from animastor_tasks.worker.tasks import app

    monkeypatch.setenv("ANIMASTOR_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    # One audio slot: each job after the first is dispatched by the refill of the job before it.
    monkeypatch.setenv(
        "ANIMASTOR_STAGES",
        '{"audio": {"queue": "gpu.audio", "input": "text", "media_type": "audio/wav", "lane_limit": 1,'
        ' "book_quota": 1, "window": 1, "params": {"steps": 1, "step_seconds": 0}}}',
    )
    wiring.reset()
    runtime = wiring.current()
    exporter = InMemorySpanExporter()
    assert tracing.setup({"ANIMASTOR_OTEL": "1"}, exporter=exporter) is not None
    try:
        audio = runtime.settings.registry.get("audio").queue
        advertise(runtime, audio, CONTROL_QUEUE)
        with start_worker(app, perform_ping_check=False, queues=[CONTROL_QUEUE, audio], shutdown_timeout=30):
            yield runtime, exporter
    finally:
        tracing.shutdown()


def test_one_trace_from_regenerate_through_gate_to_each_job(traced: tuple[Any, InMemorySpanExporter]) -> None:
    from animastor_tasks.worker.tasks import regenerate

    runtime, exporter = traced
    runtime.catalog.import_book(make_book("traced", chapters=1, scenes=3))
    regenerate.apply_async(kwargs={"book_id": "traced", "stages": ["audio"]})

    def done() -> bool:
        rows = runtime.ports.commands.commands(book="traced")
        return bool(rows) and all(r.status == "completed" for r in rows)

    wait_for(done, 60, "the audio command completed")

    def names() -> list[str]:
        return [s.name for s in exporter.get_finished_spans()]

    wait_for(lambda: names().count("run/animastor.generate.audio") >= 3, 30, "the three job runs ended")
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    def ancestry(span: Any) -> list[str]:
        chain = []
        while span is not None:
            chain.append(span.name)
            span = by_id.get(span.parent.span_id) if span.parent is not None else None
        return chain

    (root,) = [s for s in spans if s.name == "apply_async/animastor.regenerate"]
    assert root.parent is None
    jobs = [s for s in spans if s.name == "run/animastor.generate.audio"]
    assert len(jobs) == 3, sorted(names())
    depths = []
    for job in jobs:
        assert job.context.trace_id == root.context.trace_id
        chain = ancestry(job)
        # Published by dispatch, or run next by the process whose job freed its slot (worker/chain.py)...
        assert chain[1] in ("apply_async/animastor.generate.audio", "run/animastor.generate.audio"), chain
        assert "run/animastor.regenerate" in chain, chain  # ...of a pass the regenerate started, or a refill
        assert chain[-1] == root.name, chain
        depths.append(chain.count("run/animastor.generate.audio"))
    # regenerate -> job 1 -> (its refill claims) job 2 -> job 3: each job is the parent of the next.
    assert sorted(depths) == [1, 2, 3], depths
