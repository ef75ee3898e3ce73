"""The GPU job: run one scene x stage under its lease and commit only with a current token.

At start the gate and the fencing token are re-checked (in one transaction that also
records the start); while the generator runs a watcher renews the lease every TTL/3
and turns `should_stop()` true when the book is cancelled or the lease is lost; the
output is committed with a compare-and-set on the token, so a superseded job can
never overwrite a newer one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from animastor_tasks.domain.outcomes import Outcome, compute_backoff
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.errors import ConfigError, GenerationStopped, GeneratorError, StoreUnavailable
from animastor_tasks.flow import telemetry
from animastor_tasks.flow.runtime import Runtime
from animastor_tasks.generators import GenerationRequest, Media, load_generator

log = logging.getLogger("animastor.generate")

_EXTENSIONS = {"audio/wav": ".wav", "image/png": ".png"}


@dataclass(frozen=True)
class Job:
    book_id: str
    chapter_id: str
    scene_id: str
    stage: str
    dispatch_id: str
    fencing_token: int

    @property
    def pair(self) -> tuple[str, str, str]:
        return (self.chapter_id, self.scene_id, self.stage)

    @property
    def lease_pair(self) -> tuple[str, str, str, str]:
        return (self.book_id, self.chapter_id, self.scene_id, self.stage)

    def describe(self) -> str:
        return (
            f"book={self.book_id!r} chapter={self.chapter_id!r} scene={self.scene_id!r} stage={self.stage}"
            f" dispatch={self.dispatch_id} token={self.fencing_token}"
        )


class Watcher(threading.Thread):
    """Renews the lease every TTL/3 and watches the cancel flag; sets `stop` when either is lost."""

    def __init__(self, rt: Runtime, job: Job, spec: StageSpec, poll: float = 0.25) -> None:
        super().__init__(name=f"lease-{job.dispatch_id[:8]}", daemon=True)
        self.rt, self.job, self.spec, self.poll = rt, job, spec, poll
        self.stop = threading.Event()
        self.done = threading.Event()
        self.why = ""

    def run(self) -> None:
        renew_every = self.spec.lease_ttl / 3
        next_renew = time.monotonic() + renew_every
        while not self.done.wait(self.poll):
            try:
                if self.rt.coord.cancel_flag_set(self.job.book_id):
                    self._halt("book cancelled")
                    return
                if time.monotonic() >= next_renew:
                    next_renew = time.monotonic() + renew_every
                    if not self.rt.coord.renew_lease(self.job.lease_pair, self.job.dispatch_id, self.spec.lease_ttl):
                        self._halt("lease lost")
                        return
                    self.rt.coord.touch_delivery(self.job.dispatch_id, self.spec.lease_ttl)
            except StoreUnavailable as err:
                log.warning("[GENERATE] %s watcher cannot reach redis: %s", self.job.describe(), err)

    def _halt(self, why: str) -> None:
        self.why = why
        self.stop.set()
        log.info("[GENERATE] %s stopping: %s", self.job.describe(), why)

    def should_stop(self) -> bool:
        return self.stop.is_set()


def run_job(
    rt: Runtime, job: Job, *, worker: str, progress: Callable[[float], None] = lambda _: None
) -> dict[str, Any]:
    spec = rt.settings.registry.get(job.stage)
    result: dict[str, Any] = {"dispatch_id": job.dispatch_id, "book_id": job.book_id, "stage": job.stage}
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        result["gpu"] = os.environ["CUDA_VISIBLE_DEVICES"]  # which GPU ran it, for Flower and operators
    owned, cancelled = rt.coord.claim_delivery(job.dispatch_id, worker, spec.lease_ttl, job.book_id)
    if not owned:
        log.warning("[GENERATE] %s duplicate delivery while another copy runs; not run again", job.describe())
        telemetry.record(rt, "job:duplicate_delivery")
        return {**result, "outcome": "duplicate_delivery"}
    try:
        if cancelled:
            return _reject(rt, job, "cancelled", result)
        return _run_owned(rt, job, spec, worker, progress, result)
    finally:
        rt.coord.end_delivery(job.dispatch_id)


def _reject(rt: Runtime, job: Job, why: str, result: dict[str, Any]) -> dict[str, Any]:
    log.info("[GENERATE] %s fence_rejected: %s", job.describe(), why)
    telemetry.record(rt, f"dispatch:{Outcome.FENCE_REJECTED}")
    return {**result, "outcome": str(Outcome.FENCE_REJECTED), "reason": why}


def _run_owned(
    rt: Runtime, job: Job, spec: StageSpec, worker: str, progress: Callable[[float], None], result: dict[str, Any]
) -> dict[str, Any]:
    check = rt.ledger.start_job(job.book_id, job.pair, job.fencing_token, job.dispatch_id)
    if not check.ok:
        return _reject(rt, job, check.reason, result)
    log.info("[GENERATE] %s started on %s", job.describe(), worker)
    telemetry.record(rt, "job:started")

    watcher = Watcher(rt, job, spec)
    watcher.start()
    started = time.monotonic()
    try:
        try:
            generator = load_generator(spec, rt.settings)
        except ConfigError as err:
            generator = _Unavailable(str(err))
        request = GenerationRequest(
            job.book_id,
            job.chapter_id,
            job.scene_id,
            job.stage,
            check.text if spec.input_field == "text" else check.prompt,
            dict(spec.params),
        )
        media, error, attempts = _generate_with_retries(rt, job, generator, request, watcher, progress)
        if watcher.should_stop():
            telemetry.record(rt, "job:stopped")
            return {**result, "outcome": "stopped", "reason": watcher.why}
        if media is None:
            if not rt.ledger.fail_job(job.book_id, job.pair, job.fencing_token, job.dispatch_id, error, spec.queue):
                return _reject(rt, job, "stale_token", result)
            telemetry.record(rt, "job:failed")
            log.error("[GENERATE] %s failed after %d attempt(s): %s", job.describe(), attempts, error)
            _free_capacity(rt, job)
            return {**result, "outcome": "failed", "error": error, "attempts": attempts}
        artifact = store_artifact(rt.settings.artifact_root, media, job)
        artifact.update(generator=generator.name, duration_ms=int((time.monotonic() - started) * 1000))
        if not rt.ledger.commit_job(job.book_id, job.pair, job.fencing_token, job.dispatch_id, artifact, spec.queue):
            return _reject(rt, job, "stale_token at commit; output discarded", result)
    finally:
        watcher.done.set()
        watcher.join(timeout=2)
        rt.coord.release_lease(job.lease_pair, job.dispatch_id)
    rt.coord.clear_deferrals(job.book_id, [job.pair])
    _free_capacity(rt, job)
    telemetry.record(rt, "job:ready")
    log.info("[GENERATE] %s ready sha256=%s attempts=%d", job.describe(), artifact["sha256"], attempts)
    return {**result, "outcome": "ready", "sha256": artifact["sha256"], "attempts": attempts}


def _free_capacity(rt: Runtime, job: Job) -> None:
    """The job's slot is free: the book's pairs waiting for capacity may go now, not in a minute."""
    # Every stage: the scene window is shared by the book's stages, so a finished audio job
    # can free the slot an image pair was deferred for (window_full).
    rt.coord.clear_bucket(job.book_id, "capacity")
    if rt.publisher is not None:
        rt.publisher.enqueue_gate(job.book_id)


def _generate_with_retries(
    rt: Runtime,
    job: Job,
    generator: Any,
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
            if not err.retryable or attempt > rt.settings.generate_max_retries:
                return None, message, attempt
        except Exception as err:  # a generator bug or a time limit: fail the pair, never loop on it
            log.exception("[GENERATE] %s generator raised", job.describe())
            return None, f"{type(err).__name__}: {err}", attempt
        delay = compute_backoff(attempt, base=rt.settings.retry_backoff_base, maximum=rt.settings.retry_backoff_max)
        log.warning("[GENERATE] %s attempt %d failed (%s); retry in %.1fs", job.describe(), attempt, message, delay)
        telemetry.record(rt, "job:retry")
        if watcher.stop.wait(delay):
            return None, "stopped", attempt
        if not rt.ledger.token_is_current(job.book_id, job.pair, job.fencing_token, job.dispatch_id):
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


def store_artifact(root: Path, media: Media, job: Job) -> dict[str, Any]:
    """Write the bytes under their sha256 (atomic rename; identical content is stored once)."""
    digest = hashlib.sha256(media.data).hexdigest()
    folder = root / digest[:2]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}{_EXTENSIONS.get(media.media_type, '.bin')}"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(media.data)
        os.replace(tmp, path)
    return {"sha256": digest, "size": len(media.data), "media_type": media.media_type, "path": str(path)}
