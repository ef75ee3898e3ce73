"""What a GPU job's troubles mean for its pair: pure rules that `flow.generate` feeds with facts.

- **Worker-lost starts.** A job that kills its worker process (CUDA OOM, a segfault, the OOM killer)
  never ends, so it never clears its start. The next start of the same pair (a redelivery, or a new
  dispatch after reconcile) finds that start still open and counts one worker-lost start; at the limit
  the pair fails with `worker_lost: N starts` and no GPU work is done for that start.
- **Errors.** An error raised while a job runs is either a verdict on the scene (the generator failed)
  or a store that was briefly unreachable, which is not the scene's fault: the pair is given back.
  An artifact store that refuses the output (credentials, a bucket gone, a full disk) or stays unreachable
  gives the pair back too, and counts against the queue's breaker: every pair of the lane hits the same
  store, so its failures open the breaker and the lane waits instead of failing scene after scene.
- **Run failures and the breaker.** A backend-side failure (retryable, retries spent) counts against
  the queue's circuit breaker and a success clears it; a backend failure recorded while the breaker is
  (or just became) open gives the pair back to `pending` instead of failing it, and so does a rate limit.
  So does one whose worker node has failed its last threshold runs while the breaker stayed closed (`host`):
  that node's own backend is wrong (its API key, its local server) while the others' runs succeed. A node at the
  threshold pauses, whatever the breaker answered; a rate limit does not count on a node.
"""

from __future__ import annotations

from enum import StrEnum

from animastor_tasks.domain.book import printable, storable
from animastor_tasks.errors import ArtifactStoreError, GenerationStopped, GeneratorError, StoreUnavailable

# -- worker-lost starts ---------------------------------------------------------------------------


def lost_starts(previous: int, open_start: str | None, shut_down: bool = False) -> int:
    """Worker-lost starts in a row, counting this start: one more when the previous start never ended, unless its
    worker had been told to shut down meanwhile (a rollout's kill is the operator's doing, not the scene's)."""
    return previous + 1 if open_start is not None and not shut_down else previous


def worker_lost_reason(lost: int, limit: int) -> str | None:
    """The failure reason once `lost` reaches `limit` (the pair then fails without GPU work), else None."""
    return f"worker_lost: {lost} starts" if lost >= limit else None


# -- errors while a job runs ------------------------------------------------------------------------

#: The most of a generator's error message a verdict keeps, in Postgres, the log line and the task's result.
ERROR_TEXT_LIMIT = 4000


def error_text(err: BaseException) -> str:
    """A generator's error as its verdict says it: a `GeneratorError`'s own words, any other's class name first; at
    most `ERROR_TEXT_LIMIT` characters, storable. *Why:* an error whose `str()` raised left the verdict unwritten (the
    pair re-run until it failed `worker_lost`), and one of 20 MB went whole into Redis's result store and the log."""
    try:
        words = str(err)
    except Exception as broken:  # a plugin's own __str__ that raises
        words = f"(its message could not be read: {type(broken).__name__})"
    text = words if isinstance(err, GeneratorError) else f"{type(err).__name__}: {words}"
    pieces = [printable(ch) for ch in text[:ERROR_TEXT_LIMIT]]  # cut first: escaping 20 MB took seconds
    if len(text) <= ERROR_TEXT_LIMIT and sum(map(len, pieces)) <= ERROR_TEXT_LIMIT:
        return storable("".join(pieces))
    # Cut between escapes, and counted in the error's own characters (an escaped line break is one, not two).
    room, kept = ERROR_TEXT_LIMIT - 40, 0
    for piece in pieces:
        if len(piece) > room:
            break
        room, kept = room - len(piece), kept + 1
    return storable(f"{''.join(pieces[:kept])}... ({len(text) - kept} more characters)")


class ErrorKind(StrEnum):
    STOPPED = "stopped"  # cancel or a lost lease: nothing committed, the pair is someone else's now
    BACKEND = "backend"  # the generator's backend failed, worth retrying (5xx, refused, timeout)
    RATE_LIMITED = "rate_limited"  # the backend refused for now, whoever asked (429): retried, then given back
    MISCONFIGURED = "misconfigured"  # the stage's setup or its server refuses every request: no retry, the breaker
    SCENE = "scene"  # the generator refused this scene (not retryable): a verdict, the pair fails
    STORE = "store"  # Postgres, Redis or the broker was briefly unreachable: not the scene's fault
    ARTIFACT = "artifact"  # the artifact store refused the output or is unreachable: given back, the breaker counts it
    BUG = "bug"  # anything else a generator raised: fail the pair once rather than loop on it


def classify_error(err: BaseException) -> ErrorKind:
    """Which kind of trouble `err` is. Driver errors reach a flow as `StoreUnavailable` (the adapters
    translate them at their edge); a store error found anywhere in the cause chain of a non-generator
    error counts as a store error too."""
    if isinstance(err, GenerationStopped):
        return ErrorKind.STOPPED
    if isinstance(err, ArtifactStoreError):  # an upload the time limit ended: a hung backend, as a generator's
        return ErrorKind.BACKEND if err.timed_out else ErrorKind.ARTIFACT
    if isinstance(err, GeneratorError):
        if err.misconfigured:
            return ErrorKind.MISCONFIGURED
        if err.rate_limited:
            return ErrorKind.RATE_LIMITED
        return ErrorKind.BACKEND if err.retryable else ErrorKind.SCENE
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        if isinstance(link, StoreUnavailable):
            return ErrorKind.STORE
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return ErrorKind.BUG


# The share of the soft time limit a job's attempts may fill: a job its process runs next in the same task
# (worker/chain.py) starts within a tenth of that task's limit.
RUN_TIME_SHARE = 0.9


def another_attempt_fits(elapsed: float, delay: float, last_attempt: float, soft_time_limit: float) -> bool:
    """Whether a retry (its backoff, then an attempt as long as the last one) ends inside the job's share of
    the soft time limit. One that would not is not tried: the limit would cut it short, and the run would end
    on the time spent rather than on its backend's own error."""
    return elapsed + delay + last_attempt < RUN_TIME_SHARE * soft_time_limit


# Failures that say the stage's backend is wrong, not the scene: they count against the queue's breaker. *Why
# the misconfigured too:* a rotated API key (401) or a route gone (404) failed every pair of the lane at full speed.
# The artifact store is the last step of every job of the lane: one that refuses them all is the backend's wall.
_BLAMES_THE_BACKEND = frozenset(
    {ErrorKind.BACKEND, ErrorKind.MISCONFIGURED, ErrorKind.RATE_LIMITED, ErrorKind.ARTIFACT}
)
RETRIED = frozenset({ErrorKind.BACKEND, ErrorKind.RATE_LIMITED})  # the kinds another attempt of the job may cure


class Verdict(StrEnum):
    FAIL = "fail"  # generating -> failed with the error
    GIVE_BACK = "give_back"  # generating -> pending (compare-and-set on the token); the gate decides again


def verdict(kind: ErrorKind, breaker_state: str | None = None) -> Verdict:
    """What a job that gave up with `kind` does to its pair.

    `breaker_state` is what recording a backend failure on the queue's breaker answered ('open', 'reopened' or
    'closed'; None when it could not be recorded). A store error never fails a pair. A backend failure (or a
    misconfigured one) fails it while the breaker stays closed (a failure shorter than the threshold is taken
    as the scene's own), and gives it back once the breaker is open: the backend is down or set up wrong, the
    scene is not to blame. A rate limit (429) is the backend's word that it refuses whoever asks: the pair goes back
    whatever the breaker says. *Why:* failed while the breaker stayed closed, a rate limit longer than a job's
    retries failed that many healthy scenes for good (a lane of 8 jobs meeting it at once: 4 of them). An artifact
    store that refuses the output likewise: failed, a full disk or rotated S3 keys failed every scene that finished.
    A `host` answer (the breaker closed, but the node that ran the job failed its last threshold runs or more) gives
    the pair back as an open breaker does. *Why:* one GPU host with a wrong API key or a dead local inference server
    failed every pair it took, for good, while the other hosts' successes kept the queue's breaker closed.
    """
    if kind in (ErrorKind.STORE, ErrorKind.RATE_LIMITED, ErrorKind.ARTIFACT):
        return Verdict.GIVE_BACK
    if kind in _BLAMES_THE_BACKEND and breaker_state in ("open", "reopened", "host"):
        return Verdict.GIVE_BACK
    return Verdict.FAIL


def host_pause(streak: int, *, threshold: int, cooldown: float) -> float | None:
    """How long the process of a job whose node has failed its last `streak` runs of the queue takes no new job (None:
    it goes on): a breaker cool-down once the streak reaches the threshold, whatever the queue's breaker answered
    (`host`, or `open`/`reopened` when this failure opened it), after which its next job is the node's test (a
    success ends its streak). *Why:* a host that fails fast is idle first: it took most of the lane's jobs only to
    give them back, and a failure of its own that opened the breaker left it idle for the half-open test, which it
    failed at each cool-down, keeping the whole lane paused on every host."""
    return cooldown if streak >= threshold else None


def retest_deferral(kind: ErrorKind, breaker_state: str | None, *, cooldown: float) -> float | None:
    """How long a pair given back by a failure that found the breaker open already waits (None: not at all): past
    the next half-open test, a cool-down away, which then goes to another pair. *Why:* the half-open test is the
    first pending pair in reading order, and a scene whose text the server always fails on (a 500, a timeout) was
    that test at every cool-down, reopening the breaker each time: its book's healthy scenes never ran again. So
    was one the server always rate-limits (a 429 or a 503 with Retry-After that depends on the input), given back
    at every test. A limit every scene meets defers each test pair in turn, and none once a test passes: the
    breaker then holds no failure, which ends these deferrals (`dispatch._still_deferred`)."""
    if kind in (ErrorKind.BACKEND, ErrorKind.MISCONFIGURED, ErrorKind.RATE_LIMITED) and breaker_state == "reopened":
        return 2 * cooldown
    return None


def breaker_feed(kind: ErrorKind | None) -> bool | None:
    """What a finished run records on its queue's breaker: True (success, closes it) for a run whose media is
    stored (`kind` None), False (a failure) for a backend failure, a misconfigured one or a store refusing, nothing
    (None) otherwise: a scene refused, a stop, a bug or a store error says nothing about the backend."""
    if kind is None:
        return True
    if kind in _BLAMES_THE_BACKEND:
        return False
    return None


def node_feed(kind: ErrorKind | None) -> bool:
    """Whether a run's result that feeds the breaker (`breaker_feed`) feeds its node's streak too: all but a rate
    limit. *Why:* a 429 is the backend's word to whoever asks (a limit the farm shares); counted, it paused the hosts
    it happened to hit while others got through, and blamed their own keys (`AnimastorHostPaused`)."""
    return kind is not ErrorKind.RATE_LIMITED
