"""A job whose one attempt outlasts the soft time limit, on a real GPU worker: Celery's limit fires inside the
generator, and the run ends as a backend failure that feeds the queue's breaker, not as a generator bug."""

from __future__ import annotations

import pytest

from tests.integration.helpers import make_book

from .harness import audio_stage, image_stage, stage_table

pytestmark = pytest.mark.e2e

HANGS = {"steps": 1, "step_seconds": 30}  # a backend that answers long after the job's time is up
LIMITS = {"job_soft_time_limit": 2, "job_time_limit": 6}


def test_an_attempt_past_the_soft_time_limit_fails_as_a_backend_failure_and_feeds_the_breaker(
    make_stack, figure
) -> None:
    stack = make_stack(stages=stage_table(audio=audio_stage(), image=image_stage(params=HANGS)), **LIMITS)
    cluster = stack.cluster
    cluster.wait_ready(cluster.control(wait=False), cluster.gpu("image", wait=False))
    book = make_book("hung", chapters=1, scenes=1)
    stack.rt.catalog.import_book(book)

    stack.client.regenerate(book.book_id, ["image"], [["ch1", "s1"]])
    rows = stack.wait_commands(book.book_id, ["image"], "failed", timeout=30)

    [(error,)] = stack.query("SELECT error FROM asset_states WHERE book_id = %s AND stage = 'image'", (book.book_id,))
    assert "no result within the job's soft time limit (2 s)" in error, error
    assert "SoftTimeLimitExceeded" not in error, error
    breaker = stack.rt.redis.client.hget(stack.rt.redis.keys.breaker("gpu.image"), "failures")
    assert breaker == "1", breaker
    figure(f"command {rows['image'].status}; pair error {error!r}; gpu.image breaker failures {breaker}")
