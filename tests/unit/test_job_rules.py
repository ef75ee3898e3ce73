"""The pure rules of `domain.job_rules`: worker-lost starts, which errors fail a pair and which give it
back, and what a run feeds its queue's circuit breaker."""

from __future__ import annotations

import pytest

from animastor_tasks.config import Settings
from animastor_tasks.domain import job_rules
from animastor_tasks.domain.job_rules import (
    ErrorKind,
    Verdict,
    another_attempt_fits,
    breaker_feed,
    classify_error,
    host_pause,
    lost_starts,
    node_feed,
    retest_deferral,
    verdict,
    worker_lost_reason,
)
from animastor_tasks.errors import (
    ArtifactStoreError,
    ConfigError,
    GenerationStopped,
    GeneratorError,
    InvalidTransition,
    StoreUnavailable,
)


def test_a_start_that_finds_the_previous_one_open_counts_one_lost_start() -> None:
    assert lost_starts(0, None) == 0  # the previous start ended (or there was none)
    assert lost_starts(0, "d1") == 1  # d1 started and never ended: its worker died
    assert lost_starts(2, "d3") == 3
    assert lost_starts(2, "d3", shut_down=True) == 2  # d3's worker was told to stop first: a rollout's kill


@pytest.mark.parametrize(("lost", "limit", "reason"), [(0, 3, None), (2, 3, None), (3, 3, "worker_lost: 3 starts")])
def test_the_pair_gives_up_at_the_limit(lost: int, limit: int, reason: str | None) -> None:
    assert worker_lost_reason(lost, limit) == reason


def test_a_poison_scene_is_given_up_after_limit_lost_starts() -> None:
    """The sequence a pair whose every job kills its worker goes through, limit 3: three starts run, the
    fourth finds three lost ones and fails the pair without GPU work."""
    previous, open_start, ran = 0, None, 0
    for dispatch in ("d1", "d2", "d3", "d4", "d5"):
        lost = lost_starts(previous, open_start)
        if worker_lost_reason(lost, 3) is not None:
            break
        ran += 1
        previous, open_start = lost, dispatch  # started, then killed with its worker: never ended
    assert (ran, lost) == (3, 3)


def _caused_by(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as err:
            raise outer from err
    except Exception as err:
        return err


STORE = StoreUnavailable("redis", "redis://:pw@127.0.0.1:6379/0", "Error 111 connecting to 127.0.0.1:6379")


@pytest.mark.parametrize(
    ("err", "kind", "fails"),
    [
        # Verdicts on the scene: the pair fails (a backend failure only while the breaker stays closed).
        (GeneratorError("inference endpoint answered 400: bad prompt", retryable=False), ErrorKind.SCENE, True),
        (GeneratorError("inference endpoint answered 503", retryable=True), ErrorKind.BACKEND, True),
        (GeneratorError("inference endpoint answered 401", misconfigured=True), ErrorKind.MISCONFIGURED, True),
        (ValueError("a generator bug"), ErrorKind.BUG, True),
        (InvalidTransition("ready", "generating"), ErrorKind.BUG, True),
        # Not the scene's fault: a store briefly unreachable gives the pair back.
        (STORE, ErrorKind.STORE, False),
        (StoreUnavailable("postgres", "postgresql://db/x", "server closed the connection"), ErrorKind.STORE, False),
        (_caused_by(RuntimeError("while reporting"), STORE), ErrorKind.STORE, False),
        # Stopped (cancel, lost lease): neither; the pair is someone else's now.
        (GenerationStopped(), ErrorKind.STOPPED, False),
        # A rate limit (429) refuses whoever asks: it failed a healthy scene while the breaker stayed closed.
        (GeneratorError("inference endpoint answered 429", rate_limited=True), ErrorKind.RATE_LIMITED, False),
        # An artifact store that refuses every upload (keys rotated, a full disk) failed every scene that finished.
        (ArtifactStoreError("s3://b", "SignatureDoesNotMatch"), ErrorKind.ARTIFACT, False),
        (ArtifactStoreError("s3://b", "EndpointConnectionError", unreachable=True), ErrorKind.ARTIFACT, False),
        # An upload the job's time limit ended: a hung backend, like a generator's timeout.
        (ArtifactStoreError("s3://b", "no answer within the soft time limit", timed_out=True), ErrorKind.BACKEND, True),
    ],
)
def test_which_errors_fail_a_pair_and_which_give_it_back(err: Exception, kind: ErrorKind, fails: bool) -> None:
    assert classify_error(err) is kind
    if kind is not ErrorKind.STOPPED:
        assert (verdict(kind, "closed") is Verdict.FAIL) is fails
        assert (verdict(kind, None) is Verdict.FAIL) is fails


def test_a_backend_failure_gives_the_pair_back_once_the_breaker_is_open() -> None:
    assert verdict(ErrorKind.BACKEND, "closed") is Verdict.FAIL
    assert verdict(ErrorKind.BACKEND, "open") is Verdict.GIVE_BACK
    assert verdict(ErrorKind.BACKEND, None) is Verdict.FAIL  # breaker unreachable: today's rule, fail once
    assert verdict(ErrorKind.MISCONFIGURED, "open") is Verdict.GIVE_BACK  # a key rotated away: not the scene
    # The breaker says nothing about the scene's own refusal, nor about a bug.
    assert verdict(ErrorKind.SCENE, "open") is Verdict.FAIL
    assert verdict(ErrorKind.BUG, "open") is Verdict.FAIL
    assert verdict(ErrorKind.STORE, "closed") is Verdict.GIVE_BACK


def test_a_pair_that_failed_on_a_breaker_already_open_waits_out_the_next_test() -> None:
    """The half-open test (or a straggler of the outage) failed: the next test, a cool-down away, is another pair's.
    A failure that opened the breaker, a failure with it closed, and other kinds wait for nothing."""
    assert verdict(ErrorKind.BACKEND, "reopened") is Verdict.GIVE_BACK
    assert retest_deferral(ErrorKind.BACKEND, "reopened", cooldown=30) == 60
    assert retest_deferral(ErrorKind.MISCONFIGURED, "reopened", cooldown=30) == 60
    assert retest_deferral(ErrorKind.BACKEND, "open", cooldown=30) is None
    assert retest_deferral(ErrorKind.BACKEND, "closed", cooldown=30) is None
    assert retest_deferral(ErrorKind.BACKEND, None, cooldown=30) is None
    assert retest_deferral(ErrorKind.RATE_LIMITED, "reopened", cooldown=30) == 60  # an input-dependent limit
    assert retest_deferral(ErrorKind.STORE, "reopened", cooldown=30) is None


def test_a_host_whose_own_runs_keep_failing_gives_the_pair_back_and_pauses() -> None:
    """`host`: the queue's breaker stayed closed (other hosts' runs succeed) but this node failed its last threshold
    runs: its own backend is wrong (a rotated per-host key, its local server down), not the scene. Before, the pair
    failed for good, as with any closed breaker."""
    for kind in (ErrorKind.BACKEND, ErrorKind.MISCONFIGURED, ErrorKind.RATE_LIMITED, ErrorKind.ARTIFACT):
        assert verdict(kind, "host") is Verdict.GIVE_BACK
    assert verdict(ErrorKind.SCENE, "host") is Verdict.FAIL  # the scene's own refusal stays a verdict on it
    assert verdict(ErrorKind.BUG, "host") is Verdict.FAIL
    assert retest_deferral(ErrorKind.BACKEND, "host", cooldown=30) is None  # a well host may run it at once
    assert host_pause(3, threshold=3, cooldown=30) == 30  # its process takes no job for a cool-down, then tests it


def test_a_node_at_the_threshold_pauses_whatever_the_queue_breaker_says() -> None:
    """The streak, not the breaker's answer: a sick node whose failure opened or reopened the queue's breaker pauses
    too. *Why:* a host that fails fast is idle first; it opened the lane, then took its half-open test at each
    cool-down, failed it, and the whole lane waited again on every host. A node below the threshold never pauses."""
    assert host_pause(4, threshold=3, cooldown=30) == 30
    for streak in (0, 1, 2):
        assert host_pause(streak, threshold=3, cooldown=30) is None


def test_a_rate_limit_says_nothing_of_the_node() -> None:
    """A 429 is the backend's word to whoever asks: it feeds the queue's breaker, not the node's streak (counted, a
    limit the farm shares paused the hosts it happened to hit and blamed their keys). A success ends the streak."""
    assert node_feed(ErrorKind.RATE_LIMITED) is False
    for kind in (None, ErrorKind.BACKEND, ErrorKind.MISCONFIGURED, ErrorKind.ARTIFACT):
        assert node_feed(kind) is True


def test_what_a_run_feeds_the_breaker() -> None:
    assert breaker_feed(None) is True  # media produced: the backend works
    assert breaker_feed(ErrorKind.BACKEND) is False
    assert breaker_feed(ErrorKind.MISCONFIGURED) is False
    assert breaker_feed(ErrorKind.RATE_LIMITED) is False  # the lane's rate: its breaker pauses the whole lane
    assert breaker_feed(ErrorKind.ARTIFACT) is False  # every job of the lane ends at the same store
    for kind in (ErrorKind.SCENE, ErrorKind.BUG, ErrorKind.STORE, ErrorKind.STOPPED):
        assert breaker_feed(kind) is None


def test_worker_lost_limit_setting() -> None:
    assert Settings.from_env({}).worker_lost_limit == 3
    assert Settings.from_env({"ANIMASTOR_WORKER_LOST_LIMIT": "5"}).worker_lost_limit == 5
    for bad in ("0", "-1", "2.5", "inf", "three"):
        with pytest.raises(ConfigError, match="ANIMASTOR_WORKER_LOST_LIMIT"):
            Settings.from_env({"ANIMASTOR_WORKER_LOST_LIMIT": bad})


@pytest.mark.parametrize(
    ("elapsed", "delay", "last", "fits"),
    [
        (600.0, 1.0, 600.0, True),  # the second of 600 s attempts ends at 1,201 s: inside 0.9 x 1,800
        (1201.0, 2.0, 600.0, False),  # a third would end past it: the soft limit would fire inside it
        (10.0, 30.0, 5.0, True),
        (1600.0, 0.0, 1.0, True),
        (1619.0, 0.0, 1.0, False),
    ],
)
def test_a_retry_is_tried_only_when_it_ends_inside_the_jobs_time(
    elapsed: float, delay: float, last: float, fits: bool
) -> None:
    """A retry the soft time limit would cut was tried, and the limit fired inside the generator as Celery's own
    exception, classed as a bug: a backend that hung until each read timeout never fed its breaker."""
    assert another_attempt_fits(elapsed, delay, last, soft_time_limit=1800) is fits


def test_a_misconfigured_error_is_never_retried() -> None:
    assert GeneratorError("redirected", retryable=True, misconfigured=True).retryable is False


def test_a_rate_limit_is_retried_unless_misconfigured_too() -> None:
    assert GeneratorError("429", retryable=False, rate_limited=True).retryable is True
    limited_and_wrong = GeneratorError("429 from a wrong route", misconfigured=True, rate_limited=True)
    assert classify_error(limited_and_wrong) is ErrorKind.MISCONFIGURED and not limited_and_wrong.retryable


def test_an_error_text_cut_says_how_many_of_its_own_characters_it_left_out() -> None:
    """Review: the count was of escaped characters (a '\\n' is two), '2040 more' where 3,360 were left out."""
    shown = job_rules.error_text(GeneratorError("a\n" * 3000))
    assert len(shown) <= job_rules.ERROR_TEXT_LIMIT
    kept = shown[: shown.index("...")]
    left = int(shown.rsplit("(", 1)[1].split()[0])
    assert len(kept.replace("\\n", "\n")) + left == 6000, shown[-60:]


def test_a_short_error_text_that_grows_past_the_limit_when_escaped_says_it_was_cut() -> None:
    """Review: 2,500 line breaks became 2,000 escaped ones and no word of the 500 others."""
    shown = job_rules.error_text(GeneratorError("\n" * 2500))
    assert len(shown) <= job_rules.ERROR_TEXT_LIMIT
    assert shown.endswith(f"... ({2500 - shown.count(chr(92) + 'n')} more characters)"), shown[-60:]


def test_an_error_text_is_never_cut_inside_an_escape() -> None:
    shown = job_rules.error_text(GeneratorError("a" + "\x1b" * 3000))
    kept = shown[: shown.index("...")]
    assert kept == "a" + "\\x1b" * ((len(kept) - 1) // 4) and (len(kept) - 1) % 4 == 0
