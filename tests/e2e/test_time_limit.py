"""A job whose one attempt outlasts the soft time limit, on a real GPU worker: Celery's limit fires inside the
generator, and the run ends as a backend failure that feeds the queue's breaker, not as a generator bug."""

from __future__ import annotations

import pytest

from tests.integration.helpers import make_book
from tests.support.silent_server import silent_server

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


def test_an_upload_past_the_soft_time_limit_fails_the_pair_with_the_artifact_stores_name(make_stack, figure) -> None:
    """The limit fired inside the upload, where no one answered it: the task failed with Celery's exception, the
    pair stayed `generating` without a lease, was taken over and run again, and each such start counted as one
    lost to a dead worker until the pair failed as `worker_lost`; the GPU work was redone each time."""
    stack = make_stack(stages=stage_table(audio=audio_stage(), image=image_stage()), **LIMITS)
    cluster = stack.cluster
    with silent_server() as port:
        s3 = {
            "ANIMASTOR_ARTIFACT_URL": "s3://hung-bucket",
            "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "e2e",
            "AWS_SECRET_ACCESS_KEY": "e2e-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        cluster.wait_ready(cluster.control(wait=False), cluster.gpu("image", wait=False, env=s3))
        book = make_book("slow-store", chapters=1, scenes=1)
        stack.rt.catalog.import_book(book)
        stack.client.regenerate(book.book_id, ["image"], [["ch1", "s1"]])
        rows = stack.wait_commands(book.book_id, ["image"], "failed", timeout=30)

    [(error,)] = stack.query("SELECT error FROM asset_states WHERE book_id = %s AND stage = 'image'", (book.book_id,))
    assert "artifact store s3://hung-bucket" in error and "soft time limit (2 s)" in error, error
    started = "SELECT count(*) FROM events WHERE kind = 'job.started' AND book_id = %s"
    [(starts,)] = stack.query(started, (book.book_id,))
    assert starts == 1, starts
    figure(f"command {rows['image'].status}; pair error {error!r}; starts {starts}")
