"""The GPU job: run one scene x stage under its lease and commit only with a current token.

At start the gate and the fencing token are re-checked by `domain.gate.decide_job_start`
over facts read under the pair's row lock (the same transaction records the start).
While the generator runs, a watcher renews the lease every TTL/3 and turns
`should_stop()` true when the book is cancelled or the lease is lost. The output is
committed with a compare-and-set on the token, so a superseded job can never
overwrite a newer one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from animastor_tasks.domain.deferral import compute_backoff
from animastor_tasks.domain.gate import BookFacts, Denial, JobStartFacts, decide_job_start
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.types import BookPair, Pair
from animastor_tasks.domain.vocabulary import DeferralBucket, JobOutcome, Outcome
from animastor_tasks.errors import ConfigError, GenerationStopped, GeneratorError, StoreUnavailable
from animastor_tasks.ports import GenerationRequest, Generator, JobRow, Media, Ports

log = logging.getLogger("animastor.generate")


@dataclass(frozen=True)
class Job:
    book_id: str
    chapter_id: str
    scene_id: str
    stage: str
    dispatch_id: str
    fencing_token: int

    @property
    def pair(self) -> Pair:
        return (self.chapter_id, self.scene_id, self.stage)

    @property
    def lease_pair(self) -> BookPair:
        return (self.book_id, self.chapter_id, self.scene_id, self.stage)

    def describe(self) -> str:
        return (
            f"book={self.book_id!r} chapter={self.chapter_id!r} scene={self.scene_id!r} stage={self.stage}"
            f" dispatch={self.dispatch_id} token={self.fencing_token}"
        )


class Watcher(threading.Thread):
    """Renews the lease every TTL/3 and watches the cancel flag; sets `stop` when either is lost."""

    def __init__(self, ports: Ports, job: Job, spec: StageSpec, poll: float = 0.25) -> None:
        super().__init__(name=f"lease-{job.dispatch_id[:8]}", daemon=True)
        self.ports, self.job, self.spec, self.poll = ports, job, spec, poll
        self.stop = threading.Event()
        self.done = threading.Event()
        self.why = ""

    def run(self) -> None:
        renew_every = self.spec.lease_ttl / 3
        next_renew = time.monotonic() + renew_every
        while not self.done.wait(self.poll):
            try:
                if self.ports.book_state.cancel_flag_set(self.job.book_id):
                    self._halt("book cancelled")
                    return
                if time.monotonic() >= next_renew:
                    next_renew = time.monotonic() + renew_every
                    if not self.ports.leases.renew_lease(
                        self.job.lease_pair, self.job.dispatch_id, self.spec.lease_ttl
                    ):
                        self._halt("lease lost")
                        return
                    self.ports.leases.touch_delivery(self.job.dispatch_id, self.spec.lease_ttl)
            except StoreUnavailable as err:
                log.warning("[GENERATE] %s watcher cannot reach redis: %s", self.job.describe(), err)

    def _halt(self, why: str) -> None:
        self.why = why
        self.stop.set()
        log.info("[GENERATE] %s stopping: %s", self.job.describe(), why)

    def should_stop(self) -> bool:
        return self.stop.is_set()


def run_job(
    ports: Ports, job: Job, *, worker: str, progress: Callable[[float], None] = lambda _: None
) -> dict[str, Any]:
    spec = ports.settings.registry.get(job.stage)
    result: dict[str, Any] = {"dispatch_id": job.dispatch_id, "book_id": job.book_id, "stage": job.stage}
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        result["gpu"] = os.environ["CUDA_VISIBLE_DEVICES"]  # which GPU ran it, for Flower and operators
    owned, cancelled = ports.leases.claim_delivery(job.dispatch_id, worker, spec.lease_ttl, job.book_id)
    if not owned:
        log.warning("[GENERATE] %s duplicate delivery while another copy runs; not run again", job.describe())
        ports.counters.add({"job:duplicate_delivery": 1})
        return {**result, "outcome": JobOutcome.DUPLICATE_DELIVERY}
    try:
        return _run_owned(ports, job, spec, worker, progress, result, cancel_flag=cancelled)
    finally:
        ports.leases.end_delivery(job.dispatch_id)


def _reject(ports: Ports, job: Job, why: str, result: dict[str, Any]) -> dict[str, Any]:
    log.info("[GENERATE] %s fence_rejected: %s", job.describe(), why)
    ports.counters.add({f"dispatch:{Outcome.FENCE_REJECTED}": 1})
    return {**result, "outcome": JobOutcome.FENCE_REJECTED, "reason": why}


def _start(ports: Ports, job: Job, cancel_flag: bool) -> tuple[Denial | None, JobRow | None]:
    """The gate and the fencing token judged over facts read under the pair's row lock; the start
    is journalled in the same transaction when the job may go."""
    with ports.jobs.starting(job.book_id, job.pair) as start:
        row = start.row
        book = BookFacts(
            registry_readable=True,
            cancel_flag=cancel_flag,
            tombstone=row is not None and row.tombstone,
            layers_raw=None if row is None else row.layers_raw,
            commanded=frozenset({job.pair}) if row is not None and row.commanded else frozenset(),
        )
        facts = JobStartFacts(
            book,
            found=row is not None,
            state=None if row is None else row.state,
            token=None if row is None else row.token,
            owner=None if row is None else row.owner,
        )
        denial = decide_job_start(facts, job.pair, job.fencing_token, job.dispatch_id)
        if denial is None:
            start.record_start(job.fencing_token, job.dispatch_id)
        return denial, row


def _run_owned(
    ports: Ports,
    job: Job,
    spec: StageSpec,
    worker: str,
    progress: Callable[[float], None],
    result: dict[str, Any],
    *,
    cancel_flag: bool,
) -> dict[str, Any]:
    denial, row = _start(ports, job, cancel_flag)
    if denial is not None or row is None:
        return _reject(ports, job, denial or Denial.UNKNOWN_PAIR, result)
    log.info("[GENERATE] %s started on %s", job.describe(), worker)
    ports.counters.add({"job:started": 1})

    watcher = Watcher(ports, job, spec)
    watcher.start()
    started = time.monotonic()
    try:
        generator: Generator
        try:
            generator = ports.generators.load(spec)
        except ConfigError as err:
            generator = _Unavailable(str(err))
        request = GenerationRequest(
            job.book_id,
            job.chapter_id,
            job.scene_id,
            job.stage,
            row.text if spec.input_field == "text" else row.prompt,
            dict(spec.params),
        )
        media, error, attempts = _generate_with_retries(ports, job, generator, request, watcher, progress)
        if watcher.should_stop():
            ports.counters.add({"job:stopped": 1})
            return {**result, "outcome": JobOutcome.STOPPED, "reason": watcher.why}
        if media is None:
            if not ports.jobs.fail_job(job.book_id, job.pair, job.fencing_token, job.dispatch_id, error, spec.queue):
                return _reject(ports, job, Denial.STALE_TOKEN, result)
            ports.counters.add({"job:failed": 1})
            log.error("[GENERATE] %s failed after %d attempt(s): %s", job.describe(), attempts, error)
            _free_capacity(ports, job)
            return {**result, "outcome": JobOutcome.FAILED, "error": error, "attempts": attempts}
        artifact = ports.artifacts.put(media.data, media.media_type)
        artifact.update(generator=generator.name, duration_ms=int((time.monotonic() - started) * 1000))
        if not ports.jobs.commit_job(job.book_id, job.pair, job.fencing_token, job.dispatch_id, artifact, spec.queue):
            return _reject(ports, job, f"{Denial.STALE_TOKEN} at commit; output discarded", result)
    finally:
        watcher.done.set()
        watcher.join(timeout=2)
        ports.leases.release_lease(job.lease_pair, job.dispatch_id)
    ports.deferrals.clear_deferrals(job.book_id, [job.pair])
    _free_capacity(ports, job)
    ports.counters.add({"job:ready": 1})
    log.info("[GENERATE] %s ready sha256=%s attempts=%d", job.describe(), artifact["sha256"], attempts)
    return {**result, "outcome": JobOutcome.READY, "sha256": artifact["sha256"], "attempts": attempts}


def _free_capacity(ports: Ports, job: Job) -> None:
    """The job's slot is free: the book's pairs waiting for capacity may go now, not in a minute."""
    # Every stage: the scene window is shared by the book's stages, so a finished audio job
    # can free the slot an image pair was deferred for (window_full).
    ports.deferrals.clear_bucket(job.book_id, DeferralBucket.CAPACITY)
    ports.publisher.enqueue_gate(job.book_id)


def _generate_with_retries(
    ports: Ports,
    job: Job,
    generator: Generator,
    request: GenerationRequest,
    watcher: Watcher,
    progress: Callable[[float], None],
) -> tuple[Media | None, str, int]:
    """(media, last error, attempts); each retry waits a capped backoff and re-checks the gate."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return generator.generate(request, watcher.should_stop, progress), "", attempt
        except GenerationStopped:
            watcher.stop.set()
            return None, "stopped", attempt
        except GeneratorError as err:
            message = str(err)
            if not err.retryable or attempt > ports.settings.generate_max_retries:
                return None, message, attempt
        except Exception as err:  # a generator bug or a time limit: fail the pair, never loop on it
            log.exception("[GENERATE] %s generator raised", job.describe())
            return None, f"{type(err).__name__}: {err}", attempt
        delay = compute_backoff(
            attempt, base=ports.settings.retry_backoff_base, maximum=ports.settings.retry_backoff_max
        )
        log.warning("[GENERATE] %s attempt %d failed (%s); retry in %.1fs", job.describe(), attempt, message, delay)
        ports.counters.add({"job:retry": 1})
        if watcher.stop.wait(delay):
            return None, "stopped", attempt
        if not ports.jobs.token_is_current(job.book_id, job.pair, job.fencing_token, job.dispatch_id):
            watcher.why = "superseded during retry"
            watcher.stop.set()
            return None, "stopped", attempt


class _Unavailable:
    """Stands in for a generator that cannot be loaded: the pair fails with the reason, once."""

    name = "unavailable"

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def generate(self, request: GenerationRequest, should_stop: Callable[[], bool], progress: Any) -> Media:
        raise GeneratorError(self.reason, retryable=False)
