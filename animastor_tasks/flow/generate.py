"""The GPU job: run one scene x stage under its lease and commit only with a current token.

At start the job must still hold the queued lease its dispatch took (domain/liveness.py), and the gate and
the fencing token are re-checked by `domain.gate.decide_job_start` over facts read under the pair's row
lock (the same transaction records the start). While the generator runs, a watcher renews the lease every
TTL/3 and turns `should_stop()` true when the book is cancelled or the lease is lost or swapped for a stop marker
(each looked at every poll). The output is committed with a compare-and-set on the token, so a superseded job can
never overwrite a newer one; a stopped job's pair is taken over as it ends (`takeover.take_over_stopped`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from animastor_tasks.domain.book import storable
from animastor_tasks.domain.deferral import retry_delay
from animastor_tasks.domain.gate import BookFacts, Denial, JobStartFacts, decide_job_start
from animastor_tasks.domain.job_rules import (
    RETRIED,
    ErrorKind,
    Verdict,
    another_attempt_fits,
    classify_error,
    error_text,
    lost_starts,
    retest_deferral,
    verdict,
    worker_lost_reason,
)
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.targets import stop_marker
from animastor_tasks.domain.vocabulary import DeferralBucket, JobOutcome, Outcome
from animastor_tasks.errors import ArtifactStoreError, GeneratorError, StoreUnavailable
from animastor_tasks.flow import refill, takeover
from animastor_tasks.flow.host_health import pause_if_sick, pause_while_unanswered, record_breaker, sick_host
from animastor_tasks.flow.job import (
    Job,
    Later,
    Watcher,
    beside_the_job,
    checked_media,
    guarded_progress,
    load_generator,
    log_raised,
    quietly,
    refusal_kind,
    start_delivery,
    when_reachable,
)
from animastor_tasks.ports import Committed, GenerationRequest, Generator, JobRow, Media, Ports

log = logging.getLogger("animastor.generate")


def run_job(
    ports: Ports,
    job: Job,
    *,
    worker: str,
    progress: Callable[[float], None] = lambda _: None,
    later: Later | None = None,
) -> dict[str, Any]:
    later = later or Later()
    spec = ports.settings.registry.get(job.stage)
    result: dict[str, Any] = {"dispatch_id": job.dispatch_id, "book_id": job.book_id, "stage": job.stage}
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        result["gpu"] = os.environ["CUDA_VISIBLE_DEVICES"]  # which GPU ran it, for Flower and operators
    # The queued lease this dispatch took must still be ours; held, it becomes the running job's lease (TTL,
    # renewed every TTL/3) in the same atomic step that ends the undelivered marker, so a worker that dies
    # after it leaves a job whose lease lapses (domain/liveness.py).
    held, owned, cancelled, dispatched_at = start_delivery(ports, job, worker, spec.lease_ttl)
    if not held or not owned:
        later.job_started()
    if not held:
        # Gone: the pair was taken over (or released) while the job waited, so it must not start.
        return _reject(ports, job, "lease lost before start", result)
    if not owned:
        log.warning("[GENERATE] %s duplicate delivery while another copy runs; not run again", job.describe())
        ports.counters.add({f"job:duplicate_delivery:{job.stage}": 1})
        return {**result, "outcome": JobOutcome.DUPLICATE_DELIVERY}
    delivered = _Delivered(ports, job, cancelled, dispatched_at)
    try:
        outcome = _run_owned(
            ports, job, spec, worker, guarded_progress(progress, job), result, later=later, delivered=delivered
        )
        delivered.stopped = outcome["outcome"] in (JobOutcome.STOPPED, JobOutcome.FENCE_REJECTED)
    finally:
        later(partial(quietly, "end of delivery", delivered.end))
        if delivered.unanswered:
            pause_while_unanswered(ports, spec, worker, later)
    return pause_if_sick(ports, spec, worker, later, outcome)  # its node's runs keep failing: a pause, once it is over


def _reject(ports: Ports, job: Job, why: str, result: dict[str, Any]) -> dict[str, Any]:
    log.info("[GENERATE] %s fence_rejected: %s", job.describe(), why)
    ports.counters.add({f"dispatch:{Outcome.FENCE_REJECTED}": 1})
    return {**result, "outcome": JobOutcome.FENCE_REJECTED, "reason": why}


def _refused(
    ports: Ports, job: Job, spec: StageSpec, denial: Denial, result: dict[str, Any], delivered: _Delivered
) -> dict[str, Any]:
    """Refused at its start check. A pair the gate denies (a Stop All, its layer off, no command) is still this
    job's: it goes back to `pending` for its book's pass to release (its layer off: released now, `Jobs.give_back`),
    and its lease and slot are freed now rather than when the lease lapses and the tick takes the pair over. A job
    superseded as it was being delivered (stale token) lets go of the stop marker a forced regenerate left it, which
    held the slot for a lease TTL."""
    if denial in (Denial.CANCELLED, Denial.LAYER_DISABLED, Denial.NO_ACTIVE_TASK):
        try:
            released = denial is Denial.LAYER_DISABLED
            back = ports.jobs.give_back(*job.owned, denial, spec.queue, released=released, ran=False)
        except StoreUnavailable as err:
            log.warning("[GENERATE] %s refused; its pair is left to its lease: %s", job.describe(), err)
            back = None
        if back:
            delivered.release = True
            quietly("free capacity", _free_capacity, ports, job, spec, back)
            quietly("mark due", ports.book_state.set_due, job.book_id, ports.clock())  # its pass releases the pair
    elif denial is Denial.STALE_TOKEN:
        delivered.release = True
        return _stale(ports, job, result)
    return _reject(ports, job, denial, result)


def _stale(ports: Ports, job: Job, result: dict[str, Any]) -> dict[str, Any]:
    """The pair is no longer this job's (claimed anew; or its claim lost in a Postgres crash, a write's answer lost):
    its book's pass decides, now. *Why:* off the due index and the list, a pair left `pending` waited for reconcile."""
    quietly("mark due", ports.book_state.set_due, job.book_id, ports.clock())
    return _reject(ports, job, Denial.STALE_TOKEN, result)


def _start(ports: Ports, job: Job, cancel_flag: bool) -> tuple[Denial | None, JobRow | None, str | None]:
    """The gate and the fencing token judged over facts read under the pair's row lock; the start
    is journalled (and kept open until the job ends) in the same transaction when the job may go.
    The third value is the reason to fail the pair without GPU work: too many starts lost their worker."""
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
        if denial is not None or row is None:
            return denial, row, None
        lost = lost_starts(row.lost_starts, row.open_start, row.open_start_shut_down)
        gave_up = worker_lost_reason(lost, ports.settings.worker_lost_limit)
        if gave_up is None:
            start.record_start(job.fencing_token, job.dispatch_id, lost)
        return None, row, gave_up


def _run_owned(
    ports: Ports,
    job: Job,
    spec: StageSpec,
    worker: str,
    progress: Callable[[float], None],
    result: dict[str, Any],
    *,
    later: Later,
    delivered: _Delivered,
) -> dict[str, Any]:
    try:
        denial, row, worker_lost = _start(ports, job, delivered.cancelled)
    except StoreUnavailable:
        # No GPU work yet: the lease goes with the delivery, and the tick takes the pair over once Postgres answers
        # (left, each job of a queue drained during an outage held a slot idle for the rest of its lease TTL).
        delivered.release = delivered.unanswered = True
        later.job_started()  # the check is over, unanswered: the delivery was this one's, and ends with it
        raise
    later.job_started()
    if denial is not None or row is None:
        return _refused(ports, job, spec, denial or Denial.UNKNOWN_PAIR, result, delivered)
    if worker_lost is not None:
        return _give_up(ports, job, spec, worker_lost, result)
    log.info("[GENERATE] %s started on %s", job.describe(), worker)
    ports.counters.add({f"job:started:{job.stage}": 1})
    if delivered.dispatched_at:  # its wait in its queue, both ends by the Redis server's clock (`Ports.clock`)
        ports.counters.observe(f"queue_wait_seconds:{job.stage}", max(0.0, ports.clock() - delivered.dispatched_at))

    watcher = Watcher(ports, job, spec, worker)
    watcher.start()
    started = time.monotonic()
    try:
        generator = load_generator(ports, spec, job)
        source = row.text if spec.input_field == "text" else row.prompt
        request = GenerationRequest(job.book_id, job.chapter_id, job.scene_id, job.stage, source, dict(spec.params))
        media, error, attempts, kind = _generate_with_retries(ports, job, generator, request, watcher, progress)
        if watcher.should_stop():
            return _stopped(ports, job, watcher, result)
        if media is None:
            with later.writing_verdict(job):
                return _unsuccessful(ports, job, spec, watcher, kind or ErrorKind.BUG, error, attempts, result)
        try:  # a store that does not answer is asked again for a while, the output in hand (`when_reachable`)
            upload = partial(ports.artifacts.put, media.data, media.media_type)
            artifact = when_reachable(job, spec, watcher, upload, within_share=True, what="output")
        except ArtifactStoreError as err:  # keys, bucket, a full disk, the endpoint; a success is counted once stored
            if watcher.should_stop():
                return _stopped(ports, job, watcher, result)
            kind = refusal_kind(ports, err)  # before the soft limit is held back: it may end a probe that hangs
            with later.writing_verdict(job):
                return _unsuccessful(ports, job, spec, watcher, kind, storable(str(err)), attempts, result)
        recovered = record_breaker(ports, spec.queue, None, worker).state == "recovered"
        artifact.update(generator=generator.name, duration_ms=int((time.monotonic() - started) * 1000))
        artifact["input_hash"] = row.input_hash
        commit = partial(ports.jobs.commit_job, *job.owned, artifact, spec.queue)
        with later.writing_verdict(job):
            committed = when_reachable(job, spec, watcher, commit)
        if not committed:
            quietly("end start", ports.jobs.end_start, job.book_id, job.pair, job.dispatch_id)
            return _reject(ports, job, f"{Denial.STALE_TOKEN} at commit; output discarded", result)
        quietly("free capacity", _free_capacity, ports, job, spec, committed, later, recovered)  # waits for nothing
    finally:
        watcher.done.set()
        delivered.release = True
        later(partial(_wind_down, ports, job, watcher, time.monotonic() - started))
    delivered.ready = True
    # Outdated: its scene was re-imported while it ran; its media is kept, its pair `dirty` for a new command.
    outcome = JobOutcome.OUTDATED if committed.outdated else JobOutcome.READY
    later(partial(ports.counters.add, {f"job:{outcome}:{job.stage}": 1}))
    log.info("[GENERATE] %s %s sha256=%s attempts=%d", job.describe(), outcome, artifact["sha256"], attempts)
    return {**result, "outcome": outcome, "sha256": artifact["sha256"], "attempts": attempts}


def _stopped(ports: Ports, job: Job, watcher: Watcher, result: dict[str, Any]) -> dict[str, Any]:
    quietly("end start", ports.jobs.end_start, job.book_id, job.pair, job.dispatch_id)
    ports.counters.add({f"job:stopped:{job.stage}": 1})
    return {**result, "outcome": JobOutcome.STOPPED, "reason": watcher.why}


def _wind_down(ports: Ports, job: Job, watcher: Watcher, seconds: float) -> None:
    """The run is over: its watcher ends (it renews the lease no more) and its time is counted."""
    watcher.join(timeout=2)
    ports.counters.observe(f"job_seconds:{job.stage}", seconds)


@dataclass
class _Delivered:
    """A delivered job: what its delivery found, and what it leaves to Redis once it is over, in one round trip (it
    was three): the lease released when the job ran under it, its deferrals cleared if ready, the delivery ended."""

    ports: Ports
    job: Job
    cancelled: bool  # the book's cancel flag, read as the delivery was taken
    dispatched_at: float | None  # when the dispatch was published (`Ports.clock`); None: unknown
    release: bool = False
    ready: bool = False
    stopped: bool = False  # stopped or fenced off: its pair, left `generating`, taken over as it ends
    unanswered: bool = False  # Postgres did not answer its start check

    def end(self) -> None:
        leases, job = self.ports.leases, self.job
        with leases.batched():
            if self.release:
                # Its lease, and the stop marker a forced regenerate swapped in, even one its watcher never took up
                # (it returned before its next renewal): left, it kept the pair's slot idle for a lease TTL.
                leases.release_lease(job.lease_pair, job.dispatch_id)
                leases.release_lease(job.lease_pair, stop_marker(job.dispatch_id))
            if self.ready:
                self.ports.deferrals.clear_deferrals(job.book_id, [job.pair])
            leases.end_delivery(job.dispatch_id)
        if self.stopped:
            takeover.take_over_stopped(self.ports, job.book_id, [job.pair])


def _free_capacity(
    ports: Ports, job: Job, spec: StageSpec, left: Committed, later: Later | None = None, closed: bool = False
) -> None:
    """The job's slot is free, now (`refill.free_slot`). `left`: what its verdict left the book; `later`: ready."""
    with beside_the_job():
        refill.free_slot(ports, job.book_id, spec.queue, job.dispatch_id, breaker_closed=closed, after=later, left=left)


def _generate_with_retries(
    ports: Ports,
    job: Job,
    generator: Generator,
    request: GenerationRequest,
    watcher: Watcher,
    progress: Callable[[float], None],
) -> tuple[Media | None, str, int, ErrorKind | None]:
    """(media, last error, attempts, what kind of error it was); each retry of a backend failure
    waits a capped backoff and re-checks the token. Which errors end the run is `classify_error`'s."""
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        tried = time.monotonic()
        try:
            return (
                checked_media(generator, generator.generate(request, watcher.should_stop, progress)),
                "",
                attempt,
                None,
            )
        except Exception as err:  # a bug or a time limit too: classified, never looped on
            kind = classify_error(err)
            if kind is ErrorKind.STOPPED:
                watcher.stop.set()
                return None, "stopped", attempt, kind
            message = error_text(err)
            if kind is ErrorKind.BUG:
                log_raised(job, err, f"generator raised {message}")
            if kind not in RETRIED or attempt > ports.settings.generate_max_retries:
                return None, message, attempt, kind
            asked = err.retry_after if isinstance(err, GeneratorError) else None
        delay = retry_delay(
            attempt, base=ports.settings.retry_backoff_base, maximum=ports.settings.retry_backoff_max, asked=asked
        )
        now = time.monotonic()
        if not another_attempt_fits(now - started, delay, now - tried, ports.settings.job_soft_time_limit):
            return None, f"{message} (no time left for another attempt)", attempt, kind
        log.warning("[GENERATE] %s attempt %d failed (%s); retry in %.1fs", job.describe(), attempt, message, delay)
        quietly("count retry", ports.counters.add, {f"job:retry:{job.stage}": 1})
        if watcher.stop.wait(delay):
            return None, "stopped", attempt, ErrorKind.STOPPED
        try:
            current = ports.jobs.token_is_current(*job.owned)
        except StoreUnavailable as err:
            return None, f"{type(err).__name__}: {err}", attempt, ErrorKind.STORE
        if not current:
            watcher.why = "superseded during retry"
            watcher.stop.set()
            return None, "stopped", attempt, ErrorKind.STOPPED


def _unsuccessful(
    ports: Ports,
    job: Job,
    spec: StageSpec,
    watcher: Watcher,
    kind: ErrorKind,
    error: str,
    attempts: int,
    result: dict[str, Any],
) -> dict[str, Any]:
    """The run produced nothing: a backend failure feeds the queue's breaker, then `domain.job_rules.verdict`
    says whether the pair fails or goes back to `pending` (a store blip, the backend down); either is written
    through a Postgres failover (`when_reachable`)."""
    state = (recorded := record_breaker(ports, spec.queue, kind, watcher.worker)).state
    done = {**result, "error": error, "attempts": attempts, **sick_host(ports, recorded)}
    if verdict(kind, state) is Verdict.GIVE_BACK:
        why = f"breaker {state}" if kind in (ErrorKind.BACKEND, ErrorKind.MISCONFIGURED) else kind.replace("_", " ")
        try:
            back = when_reachable(job, spec, watcher, partial(ports.jobs.give_back, *job.owned, error, spec.queue))
        except StoreUnavailable as err:
            # Its lease is released (or lapses): reconcile gives it back under the lease rules.
            log.warning("[GENERATE] %s cannot give the pair back now (%s); reconcile will", job.describe(), err)
            return {**done, "outcome": JobOutcome.GIVEN_BACK}
        if not back:
            return _stale(ports, job, result)
        if (wait := retest_deferral(kind, state, cooldown=ports.settings.breaker_cooldown_seconds)) is not None:
            quietly(
                "defer", ports.deferrals.defer, job.book_id, DeferralBucket.BACKEND, [job.pair], wait, ports.clock()
            )
        quietly("count", ports.counters.add, {f"job:given_back:{job.stage}": 1})
        log.warning(
            "[GENERATE] %s given back to pending (%s) after %d attempt(s): %s", job.describe(), why, attempts, error
        )
        quietly("free capacity", _free_capacity, ports, job, spec, back)
        return {**done, "outcome": JobOutcome.GIVEN_BACK}
    if not (failed := when_reachable(job, spec, watcher, partial(ports.jobs.fail_job, *job.owned, error, spec.queue))):
        return _stale(ports, job, result)
    quietly("count", ports.counters.add, {f"job:failed:{job.stage}": 1})
    log.error("[GENERATE] %s failed after %d attempt(s): %s", job.describe(), attempts, error)
    quietly("free capacity", _free_capacity, ports, job, spec, failed)
    return {**done, "outcome": JobOutcome.FAILED}


def _give_up(ports: Ports, job: Job, spec: StageSpec, reason: str, result: dict[str, Any]) -> dict[str, Any]:
    """Too many starts of this pair lost their worker (a poison scene): fail it without GPU work."""
    try:
        failed = ports.jobs.fail_job(*job.owned, reason, spec.queue)
    finally:
        quietly("release lease", ports.leases.release_lease, job.lease_pair, job.dispatch_id)
    if not failed:
        return _stale(ports, job, result)
    quietly("count", ports.counters.add, {f"job:failed:{job.stage}": 1, f"job:worker_lost:{job.stage}": 1})
    log.error("[GENERATE] %s failed without GPU work: %s", job.describe(), reason)
    quietly("free capacity", _free_capacity, ports, job, spec, failed)
    return {**result, "outcome": JobOutcome.FAILED, "error": reason, "attempts": 0}
