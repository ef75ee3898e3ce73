"""A GPU job as its worker knows it (`Job`: what its message carries), what its worker does around its end (`Later`),
the watcher of its lease while it runs, and what it asks of its generator (loaded, and returning media)."""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from animastor_tasks.domain.deferral import compute_backoff
from animastor_tasks.domain.job_rules import (
    RUN_TIME_SHARE,
    ErrorKind,
    classify_error,
    error_text,
)
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.targets import stop_marker
from animastor_tasks.domain.types import BookPair, Pair
from animastor_tasks.errors import ArtifactStoreError, ConfigError, DeliveryNotStarted, GeneratorError, StoreUnavailable
from animastor_tasks.ports import GenerationRequest, Generator, Media, Ports

log = logging.getLogger("animastor.generate")
TRACEBACK_FRAMES = 30  # the innermost frames of a generator's traceback a log line keeps
T = TypeVar("T")
DELIVERY_START_WAITS = (0.25, 0.5, 1.0)  # seconds between the tries of a delivery's start while Redis is unreachable
PAUSE_POLL = 0.5  # seconds between looks at whether a paused process may go on (`wait_out`)
UNTIL_POLL = 1.0  # seconds between asks whether a pause's reason is over (a store answering again)


@dataclass(frozen=True)
class Job:
    book_id: str
    chapter_id: str
    scene_id: str
    stage: str
    dispatch_id: str
    fencing_token: int

    @property
    def owned(self) -> tuple[str, Pair, int, str]:
        """(book, pair, token, dispatch id): what each write of the job's verdict is compared against."""
        return self.book_id, self.pair, self.fencing_token, self.dispatch_id

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


#: True while a job's process works for others (the refill of the slot its job freed: claims of other books and
#: commands): the lines it logs meanwhile carry none of the job's ids (`worker/logs.py`).
_beside: contextvars.ContextVar[bool] = contextvars.ContextVar("animastor_beside_the_job", default=False)


@contextmanager
def beside_the_job() -> Iterator[None]:
    """*Why:* a `[DISPATCH]` line of another book's pair, claimed by a job's refill, carried that job's command_id and
    dispatch id: a search of the logs by command_id gave another command's dispatches."""
    token = _beside.set(True)
    try:
        yield
    finally:
        _beside.reset(token)


def is_beside_the_job() -> bool:
    return _beside.get()


class Later:
    """What the worker does around a job's end. Where its bookkeeping after its verdict goes (its lease, counters,
    the end of its delivery): done at once here. worker/chain.py holds it back while the next job this process
    runs starts, and runs it once that job has passed its start check, so the free GPU waits for none of it."""

    def __call__(self, step: Callable[[], object]) -> None:
        step()

    def job_started(self) -> None:
        """The job's start check is over (passed or not): bookkeeping held back may run now."""

    def pause(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        """The process takes no new job for `seconds`, or until `until()` says it may (`wait_out`): it waits here.
        worker/chain.py sends the job it kept to follow to the broker first, and ends the wait on a shutdown."""
        wait_out(time.monotonic() + seconds, until)

    def writing_verdict(self, job: Job) -> AbstractContextManager[object]:
        """Around the write of a job's verdict, which may wait out a Postgres outage (`when_reachable`): nothing
        here. A GPU worker holds its soft time limit back meanwhile (worker/time_limit.py): the limit is for a
        generator that runs too long, and fired in that wait it threw away the finished job's GPU work."""
        return nullcontext()


def wait_out(ends: float, until: Callable[[], bool] | None, going_on: Callable[[], bool] = lambda: True) -> None:
    """Waits until `ends` (`time.monotonic`), less once `until()` is true (asked every `UNTIL_POLL` seconds, the first
    time one in: its caller has just asked) or `going_on()` false (looked at every `PAUSE_POLL` seconds)."""
    asked = time.monotonic()
    while going_on() and (left := ends - time.monotonic()) > 0:
        if until is not None and time.monotonic() - asked >= UNTIL_POLL:
            asked = time.monotonic()
            if until():
                return
        time.sleep(min(left, PAUSE_POLL))


class Watcher(threading.Thread):
    """Renews the lease every TTL/3 and watches the cancel flag and the lease; sets `stop` when either is lost.

    A job a forced regenerate fenced off finds its lease swapped for its stop marker: it stops, and the
    watcher renews the marker until the job has returned (`done`), so the pair keeps its slot (and is not
    taken over and run a second time) while a generator deaf to `should_stop` (a long backend call) runs on.

    A lease that is simply gone (Redis lost its data, or answered again after the lease lapsed) is taken back
    when Postgres still says the pair is this job's, while nobody else holds it. *Why:* a Redis restart without
    persistence stopped every running job at its next renewal, and their GPU work was done again from the start;
    the takeover waits a lease TTL after such a loss for the jobs to take their leases back.
    """

    def __init__(self, ports: Ports, job: Job, spec: StageSpec, worker: str, poll: float = 0.25) -> None:
        super().__init__(name=f"lease-{job.dispatch_id[:8]}", daemon=True)
        self.ports, self.job, self.spec, self.worker, self.poll = ports, job, spec, worker, poll
        self.stop = threading.Event()
        self.done = threading.Event()
        self.why = ""
        self.holding = job.dispatch_id  # what the pair's lease holds for this job: its dispatch id, or its stop marker
        self.started_at = time.monotonic()  # the job's run began: its share of the soft time limit counts from here

    def run(self) -> None:
        renew_every = self.spec.lease_ttl / 3
        next_renew = time.monotonic() + renew_every
        leases, pair, ttl = self.ports.leases, self.job.lease_pair, self.spec.lease_ttl
        while not self.done.wait(self.poll):
            try:
                holder, cancelled = leases.watch(pair, self.job.book_id)
                if not self.stop.is_set() and cancelled:
                    self._halt("book cancelled")
                    return
                if holder != self.holding:
                    # Not what it holds (a forced regenerate's stop marker, gone, another dispatch's): judged now, as
                    # at a renewal. *Why not at the next renewal only:* a third of a lease TTL away (40 s by default),
                    # a fenced-off job ran on meanwhile, its slot doing work thrown away while the reader's fresh run
                    # waited; and a Stop All (which lets go of the lease) then a regenerate (which lifts the flag)
                    # left it running beside the fresh run of its pair, the lane one over full.
                    next_renew = time.monotonic()
                if time.monotonic() >= next_renew:
                    next_renew = time.monotonic() + renew_every
                    if leases.renew_lease(pair, self.holding, ttl):
                        leases.touch_delivery(self.job.dispatch_id, ttl)
                    elif self.holding == self.job.dispatch_id and leases.renew_lease(
                        pair, stop_marker(self.holding), ttl
                    ):
                        self.holding = stop_marker(self.holding)
                        self._halt("superseded by a forced regenerate")
                    elif self.holding == self.job.dispatch_id and self._take_back():
                        log.warning("[GENERATE] %s lease was gone (a Redis loss?): taken back", self.job.describe())
                    else:
                        self._halt("lease lost")
                        return
            except StoreUnavailable as err:
                log.warning("[GENERATE] %s watcher cannot reach redis: %s", self.job.describe(), err)

    def _take_back(self) -> bool:
        """The vanished lease taken back while nobody holds it, kept if the pair is still this job's in Postgres.
        The lease first, then Postgres under the row's lock: a takeover either saw the lease taken back before it
        committed (and left the pair) or committed first, and then this read sees it (`flow/takeover.expire`)."""
        job, leases = self.job, self.ports.leases
        if not leases.retake_lease(job.lease_pair, job.dispatch_id, self.worker, self.spec.lease_ttl):
            return False
        current = False
        try:
            current = self.ports.jobs.token_is_current(*job.owned, locking=True)
        finally:
            if not current:
                leases.release_lease(job.lease_pair, job.dispatch_id)
        return current

    def _halt(self, why: str) -> None:
        self.why = why
        self.stop.set()
        log.info("[GENERATE] %s stopping: %s", self.job.describe(), why)

    def should_stop(self) -> bool:
        return self.stop.is_set()


# A verdict waits for its store to come back, not for a backend to recover: it asks again soon and often.
COMMIT_RETRY_FIRST, COMMIT_RETRY_MAX = 0.25, 2.0


def start_delivery(ports: Ports, job: Job, worker: str, ttl: int) -> tuple[bool, bool, bool, float | None]:
    """`Leases.start_delivery`, tried again for a few seconds while Redis cannot be reached (a start whose answer was
    lost is taken again by the same holder: lua/start_delivery.lua). Still unreachable: `DeliveryNotStarted`.
    *Why:* raised at once, the task failed and its message was acked, gone; its pair held its queued lease and the
    lane counted it running until reconcile took it over (30 s), and on RabbitMQ a Redis blip of a second or two
    emptied the queue of its whole backlog that way."""
    for wait in DELIVERY_START_WAITS:
        try:
            return ports.leases.start_delivery(job.lease_pair, job.dispatch_id, worker, ttl)
        except StoreUnavailable as err:
            log.warning("[GENERATE] %s start not recorded (%s); again in %.2fs", job.describe(), err.detail, wait)
            time.sleep(wait)
    try:
        return ports.leases.start_delivery(job.lease_pair, job.dispatch_id, worker, ttl)
    except StoreUnavailable as err:
        raise DeliveryNotStarted(err.store, err.url, err.detail) from err


def when_reachable(
    job: Job,
    spec: StageSpec,
    watcher: Watcher,
    write: Callable[[], T],
    *,
    within_share: bool = False,
    what: str = "verdict",
) -> T:
    """A job's write of its output or its verdict (its upload, its commit, its failure, its give-back), tried again
    while its store cannot be reached (a Postgres failover or restart, an S3 endpoint down or answering 5xx) until
    the job's watcher stops it (its lease lost, its book cancelled): for the job's share of its soft time limit,
    and at least a lease TTL; a late write is harmless, as its token is compared. *Why:* the verdict is the job's
    to write; lost on the first refused connection, the GPU work of a finished job was thrown away, and the start,
    left open, counted as one lost to a dead worker (three such blips failed a healthy scene as `worker_lost`).
    Given up after one lease TTL, an outage longer than that threw the work away all the same, although the
    watcher kept the lease and nobody could take the pair over. An S3 store down for a minute failed every pair
    that finished meanwhile, for good. `within_share`: only inside the job's share, for a write the soft time
    limit is not held back around (an upload: the limit ends one that hangs), so no wait of its own meets it."""
    share_ends = watcher.started_at + RUN_TIME_SHARE * watcher.ports.settings.job_soft_time_limit
    deadline = share_ends if within_share else max(time.monotonic() + spec.lease_ttl, share_ends)
    attempt = 0
    while True:
        try:
            return write()
        except (StoreUnavailable, ArtifactStoreError) as err:
            if isinstance(err, ArtifactStoreError) and not err.unreachable:
                raise
            attempt += 1
            delay = compute_backoff(attempt, base=COMMIT_RETRY_FIRST, maximum=COMMIT_RETRY_MAX)
            if time.monotonic() + delay > deadline or watcher.should_stop():
                raise
            log.warning("[GENERATE] %s %s not written (%s); again in %.1fs", job.describe(), what, err, delay)
            if watcher.stop.wait(delay):
                raise


def refusal_kind(ports: Ports, err: ArtifactStoreError) -> ErrorKind:
    """What the store's refusal of a job's output says: the store's (`artifact`: the pair goes back, the breaker
    counts it) only when the store also refuses a small upload now (`probe`); one that takes it refused this
    output alone (too big for a nearly full disk or a proxy's body limit), a verdict on the scene: it fails once.
    *Why:* given back on every refusal, such a pair ran its GPU work again without end, the lane's other stored
    outputs keeping its breaker closed."""
    kind = classify_error(err)
    if kind is not ErrorKind.ARTIFACT or err.unreachable:  # down, throttling, 5xx: the store's, whatever comes next
        return kind
    try:
        ports.artifacts.probe()
    except Exception as probed:  # refused or unreachable as well, or worse: the store's
        log.warning("[GENERATE] artifact store %s refuses a small upload too: %s", err.store, probed)
        return ErrorKind.ARTIFACT
    return ErrorKind.SCENE


def guarded_progress(progress: Callable[[float], None], job: Job) -> Callable[[float], None]:
    """Progress is for Flower only: a report that fails is logged once, never raised into the generator (it would
    fail the pair). A GPU worker's reports are sent by a thread of their own (`worker/chain.py`), so that a store
    out of reach holds no generator either."""
    warned = False

    def report(fraction: float) -> None:
        nonlocal warned
        try:
            progress(fraction)
        except Exception as err:
            if not warned:
                warned = True
                log.warning("[GENERATE] %s progress not reported: %s: %s", job.describe(), type(err).__name__, err)

    return report


class _Unavailable:
    """Stands in for a generator that cannot be loaded: the pair fails with the reason, once."""

    name = "unavailable"

    def __init__(self, error: GeneratorError) -> None:
        self.error = error

    def generate(self, request: GenerationRequest, should_stop: Callable[[], bool], progress: Any) -> Media:
        error = self.error
        raise GeneratorError(
            str(error),
            retryable=error.retryable,
            retry_after=error.retry_after,
            misconfigured=error.misconfigured,
            rate_limited=error.rate_limited,
        )


def checked_media(generator: Generator, answer: object) -> Media:
    """What a generator returned, if it is `Media` of bytes and a type, else a TypeError (a bug: the pair fails
    once, saying what came back). *Why:* a plugin's text or None raised past the job's verdict, at the hash or the
    upload, and the pair stayed `generating` until its lost starts failed it as `worker_lost`. A memoryview is
    copied to bytes: its length counts items, not bytes (a wrong size kept, the artifact written again on every
    run), and one not contiguous raised past the verdict at the hash. The type must be one a header can carry
    (`type/subtype`, printable ASCII): S3's client raised a bare ValueError past the verdict at the upload."""
    if isinstance(answer, Media) and isinstance(answer.media_type, str) and not _header_worthy(answer.media_type):
        raise TypeError(f"generator {generator.name!r} returned the media type {answer.media_type!r}, not type/subtype")
    if isinstance(answer, Media) and isinstance(answer.data, memoryview) and isinstance(answer.media_type, str):
        return replace(answer, data=bytes(answer.data))
    if isinstance(answer, Media) and isinstance(answer.data, bytes | bytearray) and isinstance(answer.media_type, str):
        return answer
    shape = type(answer).__name__
    if isinstance(answer, Media):
        shape = f"Media({type(answer.data).__name__}, {type(answer.media_type).__name__})"
    raise TypeError(f"generator {generator.name!r} returned {shape}, not Media(bytes, str)")


def _header_worthy(media_type: str) -> bool:
    return media_type.isascii() and media_type.isprintable() and "/" in media_type.split(";")[0]


def load_generator(ports: Ports, spec: StageSpec, job: Job) -> Generator:
    """The stage's generator, or a stand-in that fails each run with why it could not be loaded."""
    try:
        return ports.generators.load(spec)
    except ConfigError as err:  # the stage's setup: no verdict on the scene, it feeds the breaker
        return _Unavailable(GeneratorError(str(err), misconfigured=True))
    except GeneratorError as err:  # a factory's own verdict (misconfigured, retryable or not) stands as it said
        log.warning("[GENERATE] %s generator %r could not be loaded: %s", job.describe(), spec.generator, err)
        return _Unavailable(err)
    except Exception as err:
        # A plugin that cannot be imported is misconfigured (not retried); one whose factory failed (a GPU out of
        # memory, its backend unreachable) is a backend failure (retried). Both feed the breaker, which gives
        # the pairs back once open rather than failing a whole command in seconds.
        why = f"generator {spec.generator!r} could not be loaded: {error_text(err)}"
        log_raised(job, err, why)
        return _Unavailable(GeneratorError(why, misconfigured=isinstance(err, ImportError)))


def log_raised(job: Job, err: BaseException, words: str) -> None:
    """A generator's (or its factory's) bug, logged with its traceback's frames and its words as its verdict has them
    (`error_text`: escaped, cut). *Why not `log.exception`:* the exception's own line went to the log raw, where a
    plugin's line break forged a log line of its own and a 20 MB message made a 20 MB line."""
    frames = "".join(traceback.format_tb(err.__traceback__)[-TRACEBACK_FRAMES:]).rstrip()
    log.error("[GENERATE] %s: %s\nTraceback (most recent call last):\n%s", job.describe(), words, frames)


def quietly(what: str, fn: Callable[..., object], *args: Any) -> None:
    """Bookkeeping around a verdict (leases, deferrals, counters, gate passes): a store that cannot be
    reached here is logged and left to reconcile; it never changes what the job did to its pair."""
    try:
        fn(*args)
    except Exception as err:
        log.warning("[GENERATE] %s skipped: %s: %s", what, type(err).__name__, err)
