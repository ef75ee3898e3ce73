"""A GPU job's troubles on the real stores: a store blip never fails a pair, a pair whose starts keep losing
their worker fails after the limit, and a dead inference server opens its queue's breaker with the remaining
pairs left pending (the rules are `domain.job_rules`)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest
import redis

from animastor_tasks.dev.inference_server import InferenceServer, make_server
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.vocabulary import AssetState
from animastor_tasks.errors import GeneratorError, StoreUnavailable
from animastor_tasks.flow import gate, takeover
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.flow.job import wait_out
from animastor_tasks.generators.media import synthesize_wav
from animastor_tasks.ports import GenerationRequest, Generator, Media
from animastor_tasks.worker.wiring import Wiring

from .helpers import Pauses, advertise, make_book, states
from .test_generate import dispatched_jobs, run_with_a_loader_that_raises, with_stage
from .test_hostile_inference import answering, serve  # noqa: F401 (the fixture)

PAIR = ("ch1", "s1", "audio")


class _Generators:
    """Hands every stage the given generator (the flows' `Generators` port)."""

    def __init__(self, generator: Generator) -> None:
        self.generator = generator

    def load(self, spec: StageSpec) -> Generator:
        return self.generator


class _Scripted:
    """Produces a tiny WAV, after calling `before(request, progress)` (which may raise)."""

    name = "scripted"

    def __init__(self, before: Callable[[GenerationRequest, Callable[[float], None]], None]) -> None:
        self.before = before

    def generate(self, request: GenerationRequest, should_stop: Callable[[], bool], progress: Any) -> Media:
        self.before(request, progress)
        progress(1.0)
        return Media(b"RIFF" + request.scene_id.encode(), "audio/wav")


def _use_generator(rt: Wiring, generator: Generator) -> None:
    rt.ports = replace(rt.ports, generators=_Generators(generator))


def _events(rt: Wiring, kind: str) -> list[tuple[Any, ...]]:
    with rt.db.transaction() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                "SELECT chapter_id, scene_id, stage, dispatch_id, detail FROM events WHERE kind = %s ORDER BY id",
                (kind,),
            ).fetchall()
        ]


def _one_scene(rt: Wiring, tmp_path: Any, scenes: int = 1, **settings: Any) -> None:
    with_stage(rt, rt.settings.registry.get("audio"), tmp_path, **settings)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=scenes))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])


# -- item 7: a store blip never fails a pair ------------------------------------------------------------


def test_a_progress_report_that_cannot_reach_its_store_never_fails_the_pair(rt, tmp_path) -> None:
    """The `make faults` failure: Celery's result backend (update_state) raised redis's ConnectionError
    through the progress callback while Redis restarted, and the pair was failed after 1 attempt."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")

    def progress(fraction: float) -> None:
        raise redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")

    result = run_job(rt.ports, job, worker="test", progress=progress)
    assert result["outcome"] == "ready", result
    assert states(rt, "b")[PAIR] == "ready"
    assert _events(rt, "job.failed") == []


def test_a_store_error_in_the_run_gives_the_pair_back_to_run_again(rt, tmp_path) -> None:
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    blip = StoreUnavailable("redis", rt.settings.redis_url, "Error 111 connecting to 127.0.0.1:6379")

    def unreachable(request: GenerationRequest, progress: Any) -> None:
        raise blip

    _use_generator(rt, _Scripted(unreachable))
    result = run_job(rt.ports, job, worker="test")
    assert result["outcome"] == "given_back", result
    assert states(rt, "b")[PAIR] == "pending"  # not failed: runs again
    assert _events(rt, "job.failed") == []
    [(_, _, _, dispatch_id, detail)] = _events(rt, "job.given_back")
    assert dispatch_id == job.dispatch_id and "redis unavailable" in detail["reason"]
    assert rt.redis.client.exists(rt.redis.keys.lease("b", *PAIR)) == 0  # its lease is released

    _use_generator(rt, _Scripted(lambda request, progress: None))
    gate.gate_pass(rt.ports, "b")
    [again] = dispatched_jobs(rt, "b")
    assert again.fencing_token == job.fencing_token + 1
    assert run_job(rt.ports, again, worker="test")["outcome"] == "ready"
    [command] = rt.ports.commands.commands(book="b")
    assert command.status == "completed"


def _unreachable_for(rt: Wiring, monkeypatch: pytest.MonkeyPatch, name: str, times: int) -> list[int]:
    """`rt.ports.jobs.<name>` refuses its first `times` calls as Postgres does during a failover; the calls made."""
    real, calls = getattr(rt.ports.jobs, name), [0]

    def flaky(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] <= times:
            raise StoreUnavailable("postgres", rt.settings.database_url, "connection refused")
        return real(*args)

    monkeypatch.setattr(rt.ports.jobs, name, flaky)
    return calls


def _open_start(rt: Wiring) -> Any:
    with rt.db.transaction() as conn:
        return conn.execute("SELECT open_dispatch FROM job_starts WHERE book_id = 'b'").fetchone()[0]


def test_a_give_back_that_meets_a_postgres_failover_is_written_once_it_is_back(rt, tmp_path, monkeypatch) -> None:
    """The give-back was tried once: refused, the job left its pair `generating` with its start open, so the next
    start of the scene counted one lost to a dead worker (three such blips failed a healthy scene)."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    blip = StoreUnavailable("redis", rt.settings.redis_url, "Error 111 connecting to 127.0.0.1:6379")
    _use_generator(rt, _Scripted(lambda request, progress: (_ for _ in ()).throw(blip)))
    calls = _unreachable_for(rt, monkeypatch, "give_back", 2)
    assert run_job(rt.ports, job, worker="test")["outcome"] == "given_back"
    assert calls[0] == 3 and states(rt, "b")[PAIR] == "pending" and _open_start(rt) is None


def test_a_start_check_that_meets_a_postgres_failover_leaves_no_lease(rt, tmp_path, monkeypatch) -> None:
    """The start check could not reach Postgres: the job raised with its delivery's lease (the stage's TTL) left to
    lapse, and nothing renewed it. During an outage the workers burned through their queue, each job leaving such a
    lease, and after it every such slot idled out the rest of its `lease_ttl` (120 s by default)."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    _unreachable_for(rt, monkeypatch, "starting", 1)
    with pytest.raises(StoreUnavailable):
        run_job(rt.ports, job, worker="test")
    assert rt.redis.client.exists(rt.redis.keys.lease("b", *PAIR)) == 0
    takeover.on_tick(rt.ports)  # once Postgres answers again
    gate.gate_pass(rt.ports, "b")
    [again] = dispatched_jobs(rt, "b")
    assert again.dispatch_id != job.dispatch_id
    assert run_job(rt.ports, again, worker="test")["outcome"] == "ready"


def test_a_start_check_postgres_did_not_answer_pauses_the_process_until_it_answers(
    rt, tmp_path, monkeypatch, caplog
) -> None:
    """A host cut off from Postgres alone took every job published to the queue (e2e/test_host_without_postgres.py):
    its process now pauses once its delivery is over, a breaker cool-down at most, ended as Postgres answers."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    _unreachable_for(rt, monkeypatch, "starting", 1)
    ping = rt.db.ping
    monkeypatch.setattr(rt.db, "ping", lambda **_: (_ for _ in ()).throw(StoreUnavailable("postgres", "x", "refused")))
    later = Pauses()
    with pytest.raises(StoreUnavailable):
        run_job(rt.ports, job, worker="test@gpu-host-3", later=later)
    assert later.asked == [rt.settings.breaker_cooldown_seconds]
    [until] = later.ended_by
    assert until is not None and until() is False  # Postgres does not answer this process: the pause goes on
    monkeypatch.setattr(rt.db, "ping", ping)
    assert until() is True  # it answers again: the pause ends
    assert rt.redis.client.exists(rt.redis.keys.lease("b", *PAIR)) == 0  # released before the pause
    rt.ports.counters.flush()  # type: ignore[attr-defined]
    assert rt.redis.client.hget(rt.redis.keys.metrics(), "job:store_paused:audio") == "1"
    assert "host test@gpu-host-3: Postgres did not answer a start check of gpu.audio" in caplog.text


def test_a_start_check_whose_row_lock_wait_ran_out_asks_for_no_pause(rt, tmp_path, monkeypatch, caplog) -> None:
    """Review: a lock wait cut short is a `StoreUnavailable` too, though Postgres answered: it was said and counted as
    Postgres unreachable from the host, and operators sent to check its route."""
    from animastor_tasks.adapters.postgres import pool

    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    monkeypatch.setattr(pool, "LOCK_WAIT_MS", 300)
    with rt.db.transaction() as holder:  # another transaction holds the pair's row (a long import, a silent client)
        holder.execute(
            "SELECT 1 FROM asset_states WHERE book_id = 'b' AND chapter_id = 'ch1' AND scene_id = 's1'"
            " AND stage = 'audio' FOR UPDATE"
        ).fetchone()
        later = Pauses()
        with pytest.raises(StoreUnavailable, match="lock timeout"):
            run_job(rt.ports, job, worker="test@gpu-host-3", later=later)
    assert later.asked == []
    assert "Postgres did not answer" not in caplog.text


def test_a_pause_ends_once_its_reason_is_over_and_not_before() -> None:
    asked: list[float] = []

    def answers() -> bool:
        asked.append(time.monotonic())
        return len(asked) >= 3

    started = time.monotonic()
    wait_out(started + 30, answers)
    assert len(asked) == 3 and 2.9 < time.monotonic() - started < 5  # asked every second, the first a second in
    wait_out(time.monotonic() + 0.3, lambda: False)  # never over: the pause's length bounds it
    assert time.monotonic() - started < 5


def test_a_failure_that_meets_a_postgres_failover_is_written_once_it_is_back(rt, tmp_path, monkeypatch) -> None:
    """The failure was written once: refused, the StoreUnavailable left the job as an exception (the verdict lost,
    the start open), and the scene ran again."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    refusal = GeneratorError("the server refused the text", retryable=False)
    _use_generator(rt, _Scripted(lambda request, progress: (_ for _ in ()).throw(refusal)))
    calls = _unreachable_for(rt, monkeypatch, "fail_job", 1)
    assert run_job(rt.ports, job, worker="test")["outcome"] == "failed"
    assert calls[0] == 2 and states(rt, "b")[PAIR] == "failed" and _open_start(rt) is None


# -- item 3: a poison scene cannot loop --------------------------------------------------------------------


class _WorkerDied(BaseException):
    """Stands in for the process dying mid-job (CUDA OOM, segfault): nothing after it runs in the flow."""


def test_a_pair_whose_starts_keep_losing_their_worker_fails_after_the_limit(rt, tmp_path) -> None:
    _one_scene(rt, tmp_path, scenes=2, worker_lost_limit=3)
    ran: Counter[str] = Counter()

    def poison(request: GenerationRequest, progress: Any) -> None:
        ran[request.scene_id] += 1
        if request.scene_id == "s1":
            raise _WorkerDied

    _use_generator(rt, _Scripted(poison))
    outcomes = []
    for _round in range(6):
        jobs = {j.scene_id: j for j in dispatched_jobs(rt, "b")}
        if "s1" not in jobs:
            break
        for job in jobs.values():
            try:
                outcomes.append((job.scene_id, run_job(rt.ports, job, worker="test")["outcome"]))
            except _WorkerDied:
                outcomes.append((job.scene_id, "worker died"))
                # What reconcile does once the dead job's lease is gone: back to pending, dispatched again.
                assert rt.ports.assets.expire_generating(
                    "b", job.pair, job.fencing_token, AssetState.PENDING, lambda: True
                )
        gate.gate_pass(rt.ports, "b")
    assert outcomes == [
        ("s1", "worker died"),
        ("s2", "ready"),
        ("s1", "worker died"),
        ("s1", "worker died"),
        ("s1", "failed"),
    ]
    assert ran["s1"] == 3  # the fourth start did no GPU work
    found = states(rt, "b")
    assert found[PAIR] == "failed" and found[("ch1", "s2", "audio")] == "ready"
    with rt.db.transaction() as conn:
        error = conn.execute("SELECT error FROM asset_states WHERE scene_id = 's1' AND stage = 'audio'").fetchone()[0]
    assert error == "worker_lost: 3 starts"
    assert [d["lost_starts"] for c, s, st, _, d in _events(rt, "job.started") if s == "s1"] == [0, 1, 2]
    [command] = rt.ports.commands.commands(book="b")
    assert command.status == "failed"
    # An explicit regenerate is a new intent: the pair gets its starts again (the count was cleared).
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], scenes=[["ch1", "s1"]])
    [job] = dispatched_jobs(rt, "b")
    with pytest.raises(_WorkerDied):
        run_job(rt.ports, job, worker="test")
    assert ran["s1"] == 4


def test_a_pair_whose_live_jobs_lose_their_lease_to_partitions_is_not_failed_as_worker_lost(rt, tmp_path) -> None:
    """Each job cut off from Redis past its lease (its host alive) is taken over, then comes back and stops. Old code:
    the taken-over starts still counted as lost, and the fourth start failed a healthy scene `worker_lost: 3 starts`
    (found by a partition hunt: three 10 s cuts of the Redis link)."""
    from animastor_tasks.domain.job_rules import lost_starts

    _one_scene(rt, tmp_path, worker_lost_limit=3)
    orphan = None
    for _cut in range(3):
        [job] = dispatched_jobs(rt, "b")
        with rt.ports.jobs.starting("b", job.pair) as start:  # the start check, as a GPU worker makes it
            row = start.row
            assert row is not None
            start.record_start(job.fencing_token, job.dispatch_id, lost_starts(row.lost_starts, row.open_start))
        if orphan is not None:  # the job taken over last time is back: it finds its lease gone and stops
            rt.ports.jobs.end_start("b", orphan.pair, orphan.dispatch_id)
        orphan = job
        # The tick takes the pair over once its lease lapses; the gate dispatches it again.
        assert rt.ports.assets.expire_generating("b", job.pair, job.fencing_token, AssetState.PENDING, lambda: True)
        gate.gate_pass(rt.ports, "b")
    [job] = dispatched_jobs(rt, "b")  # the fourth start, the third orphan still cut off

    assert run_job(rt.ports, job, worker="test")["outcome"] == "ready"
    assert states(rt, "b")[PAIR] == "ready"


def _start_row(rt: Wiring) -> tuple[Any, ...]:
    with rt.db.read() as conn:
        return tuple(conn.execute("SELECT open_dispatch, lost_starts FROM job_starts WHERE book_id = 'b'").fetchone())


def test_a_job_refused_at_its_start_gives_back_no_lost_start(rt, tmp_path) -> None:
    """A job that never started (refused at its start check: a Stop All, its layer off) ends no start of its own:
    the count of starts lost to a scene that kills its worker stays (review of 11b52ad: it fell by one)."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    with rt.ports.jobs.starting("b", job.pair) as start:  # a start whose worker died, then one more
        start.record_start(job.fencing_token, "dead1", 0)
    with rt.ports.jobs.starting("b", job.pair) as start:
        start.record_start(job.fencing_token, "dead2", 1)

    rt.ports.jobs.give_back("b", job.pair, 999, "refused", "cancelled", "gpu.audio", ran=False)

    assert _start_row(rt) == ("dead2", 1)


def test_a_job_ending_as_a_newer_one_starts_leaves_that_start_open(rt, tmp_path) -> None:
    """The newer start's write lands while the older job's end waits for the row. Reading whether the row's open start
    was its own in a subquery, the end saw the old row and cleared the newer start (review of 11b52ad)."""
    import threading

    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    with rt.ports.jobs.starting("b", job.pair) as start:
        start.record_start(job.fencing_token, "older", 0)
    ended = threading.Thread(target=rt.ports.jobs.end_start, args=("b", job.pair, "older"))
    with psycopg.connect(rt.settings.database_url) as newer:  # the newer start's write, not committed yet
        newer.execute("UPDATE job_starts SET open_dispatch = 'newer', lost_starts = 1 WHERE book_id = 'b'")
        ended.start()
        time.sleep(0.5)  # the older job's end waits for the row
        newer.commit()
    ended.join(10)

    assert _start_row(rt) == ("newer", 0)  # open; the lost start it counted for the older one given back


class _Unreadable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("the plugin's __str__ raised")


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        pytest.param(_Unreadable(), "_Unreadable: (its message could not be read: RuntimeError)", id="str-raises"),
        pytest.param(RuntimeError("E" * 1_000_000), "RuntimeError: " + "E" * 3900, id="a-megabyte-message"),
        pytest.param(  # a line break and an escape sequence: a forged log line, a rewritten terminal
            ValueError("bad\n[2026-12-07 12:00:00: ERROR] forged\x1b[2J"),
            "ValueError: bad\\n[2026-12-07 12:00:00: ERROR] forged\\x1b[2J",
            id="control-characters",
        ),
    ],
)
def test_a_plugin_s_error_fails_its_pair_once_whatever_its_message(
    rt, tmp_path, raised: Exception, expected: str
) -> None:
    """Old code: an error whose `str()` raised left the job without a verdict (the pair re-run until it failed
    `worker_lost: 3 starts`), and a 20 MB message went whole into the task's result in Redis (found by a plugin
    hunt)."""
    _one_scene(rt, tmp_path)

    def raising(request: GenerationRequest, progress: Any) -> None:
        raise raised

    _use_generator(rt, _Scripted(raising))
    [job] = dispatched_jobs(rt, "b")

    result = run_job(rt.ports, job, worker="test")

    assert result["outcome"] == "failed" and len(repr(result)) < 5000, repr(result)[:300]
    with rt.db.read() as conn:
        [(error,)] = conn.execute("SELECT error FROM asset_states WHERE book_id = 'b' AND stage = 'audio'")
    assert error.startswith(expected), error[:200]


# -- item 5b: run failures feed the circuit breaker ------------------------------------------------------


def test_a_backend_that_hangs_until_the_jobs_time_runs_out_feeds_the_breaker(rt, tmp_path) -> None:
    """Each attempt hangs until its read timeout (here 0.6 s of a 1.5 s soft time limit): a retry that would
    end past 0.9 of the limit is not tried. Tried, the limit fired inside it as Celery's exception, classed as
    a generator bug: the pair failed and the breaker heard nothing."""
    _one_scene(rt, tmp_path, job_soft_time_limit=1.5, generate_max_retries=5, retry_backoff_base=0.0)

    def hang(request: GenerationRequest, progress: Any) -> None:
        time.sleep(0.6)
        raise GeneratorError("read timed out", retryable=True)

    _use_generator(rt, _Scripted(hang))
    [job] = dispatched_jobs(rt, "b")
    result = run_job(rt.ports, job, worker="test")
    assert result["outcome"] == "failed" and result["attempts"] == 2, result  # no third past 0.9 of the limit
    assert "no time left for another attempt" in result["error"]
    assert rt.redis.client.hget(rt.redis.keys.breaker("gpu.audio"), "failures") == "1"


@pytest.mark.parametrize("retryable", [False, True])
def test_an_error_text_postgres_cannot_keep_is_still_the_verdict(rt, tmp_path, caplog, retryable: bool) -> None:
    """A binary error page (a NUL) or a plugin's message with a lone surrogate: the verdict's own write raised
    psycopg's DataError, the job ended with no verdict, and the pair ran again until it failed as a lost worker.
    Retryable, with a breaker that opens at once, the pair is given back (its journal entry holds the text).
    The verdict's log line carries the same text: with the raw one, a UTF-8 log file refused the line (a
    logging error in its place) and pytest-xdist could not send the test's report."""
    _one_scene(rt, tmp_path, generate_max_retries=0, breaker_threshold=1)
    caplog.set_level("INFO", logger="animastor.generate")

    def garbled(request: GenerationRequest, progress: Any) -> None:
        raise GeneratorError("proxy said \x00\x1f\x8b then \ud800", retryable=retryable)

    _use_generator(rt, _Scripted(garbled))
    [job] = dispatched_jobs(rt, "b")
    result = run_job(rt.ports, job, worker="test", later=Pauses())
    assert result["outcome"] == ("given_back" if retryable else "failed"), result
    assert states(rt, "b")[PAIR] == ("pending" if retryable else "failed")
    kind, key = ("job.given_back", "reason") if retryable else ("job.failed", "error")
    [(*_, detail)] = _events(rt, kind)
    assert detail[key] == "proxy said \\x00\\x1f\\x8b then \\ud800"  # each written as an escape (`printable`)
    [verdict_line] = [r.getMessage() for r in caplog.records if "attempt(s): " in r.getMessage()]
    assert verdict_line.endswith(f"attempt(s): {detail[key]}"), verdict_line
    verdict_line.encode("utf-8")  # raises on a lone surrogate
    if not retryable:
        with rt.db.read() as conn:
            [(error,)] = conn.execute("SELECT error FROM asset_states WHERE book_id = 'b' AND stage = 'audio'")
        assert error == detail["error"]


def test_a_job_fenced_off_before_it_fails_closes_its_start(rt, tmp_path) -> None:
    """A job that failed after a forced regenerate had fenced it off left its start open: the fresh run counted a
    worker lost that never was (at the limit, it failed the pair without GPU work)."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    with rt.ports.jobs.starting("b", job.pair) as start:
        start.record_start(job.fencing_token, job.dispatch_id, 0)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], scenes=[["ch1", "s1"]])  # force: the job is fenced off
    assert not rt.ports.jobs.fail_job("b", job.pair, job.fencing_token, job.dispatch_id, "boom", "gpu.audio")
    with rt.db.read() as conn:
        open_dispatch, lost = conn.execute(
            "SELECT open_dispatch, lost_starts FROM job_starts WHERE book_id = 'b' AND scene_id = 's1'"
        ).fetchone()
    assert open_dispatch is None and lost == 0


@pytest.fixture
def inference() -> Iterator[InferenceServer]:
    """The reference inference server, in this process so a test can make it fail and recover on one URL."""
    server = make_server("127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, name="inference", daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_a_dead_inference_server_opens_the_breaker_and_the_pairs_wait_pending(rt, tmp_path, inference) -> None:
    inference.failure_rate = 1.0  # 503 to everything
    spec = replace(
        rt.settings.registry.get("audio"), generator="http", endpoint=f"{inference.url}/v1/generate/audio", book_cap=4
    )
    cooldown = 1.5
    with_stage(
        rt,
        spec,
        tmp_path,
        breaker_threshold=2,
        breaker_cooldown_seconds=cooldown,
        generate_max_retries=1,
        retry_backoff_base=0.01,
        retry_backoff_max=0.02,
    )
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    jobs = dispatched_jobs(rt, "b")
    assert len(jobs) == 4  # book cap

    began = time.monotonic()
    host = Pauses()
    outcomes = [run_job(rt.ports, job, worker="test", later=host)["outcome"] for job in jobs]
    opened_after = None
    breaker = rt.redis.client.hgetall(rt.redis.keys.breaker("gpu.audio"))
    assert float(breaker.get("open_until", 0)) > time.time(), breaker  # open
    # The first failure (below the threshold) is taken as the scene's own; from the one that opens the
    # breaker on, the backend is down and the pairs go back to pending.
    assert outcomes == ["failed", "given_back", "given_back", "given_back"], outcomes
    assert host.asked == [cooldown] * 3  # the one host's own streak reached the threshold too: it pauses after each
    opened_after = time.monotonic() - began
    report = gate.gate_pass(rt.ports, "b")
    # The two whose failures found it open already wait out the next test too: it goes to another pair.
    assert report.outcomes.get("breaker_open") == 3 and report.outcomes.get("deferred_capacity") == 2
    assert not dispatched_jobs(rt, "b")
    assert Counter(s for (_, _, stage), s in states(rt, "b").items() if stage == "audio") == {"pending": 5, "failed": 1}
    [command] = rt.ports.commands.commands(book="b")
    assert command.status == "active"

    # The server recovers; after the cool-down the one test permit succeeds and the rest follow.
    inference.failure_rate = 0.0
    time.sleep(cooldown + 0.1)
    gate.gate_pass(rt.ports, "b")
    [probe] = dispatched_jobs(rt, "b")  # half-open: exactly one test dispatch
    assert run_job(rt.ports, probe, worker="test")["outcome"] == "ready"
    assert rt.redis.client.exists(rt.redis.keys.breaker("gpu.audio")) == 0  # closed
    for _ in range(10):
        rt.redis.client.delete(rt.redis.keys.deferrals("b", "capacity"))
        gate.gate_pass(rt.ports, "b")
        jobs = dispatched_jobs(rt, "b")
        if not jobs:
            break
        assert {run_job(rt.ports, job, worker="test")["outcome"] for job in jobs} == {"ready"}
    assert Counter(s for (_, _, stage), s in states(rt, "b").items() if stage == "audio") == {"ready": 5, "failed": 1}
    [command] = rt.ports.commands.commands(book="b")
    assert command.status == "failed" and command.reason == "1 of 6 targets failed"
    print(f"breaker open after {opened_after:.2f}s (2 failing jobs x 2 attempts); 5 pairs waited pending")


def test_a_rejected_api_key_opens_the_breaker_instead_of_failing_every_pair(rt, tmp_path, inference) -> None:
    """A rotated key (401), like a wrong route or a redirect, is no verdict on the scene. Old code: not retryable,
    it was taken as the scene's refusal and recorded nothing on the breaker, so every pair of the lane failed at
    full speed; once the key is right again, nothing was left to run."""
    inference.api_key = "the-key-the-server-wants"
    spec = replace(
        rt.settings.registry.get("audio"), generator="http", endpoint=f"{inference.url}/v1/generate/audio", book_cap=4
    )
    with_stage(rt, spec, tmp_path, breaker_threshold=2, breaker_cooldown_seconds=30, generate_max_retries=3,
               inference_api_key="a-key-rotated-away")  # fmt: skip
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    host = Pauses()
    results = [run_job(rt.ports, job, worker="test", later=host) for job in dispatched_jobs(rt, "b")]
    assert [r["outcome"] for r in results] == ["failed", "given_back", "given_back", "given_back"], results
    assert host.asked == [30] * 3  # its streak at the threshold: the host pauses, the next test is another's
    assert all(r["attempts"] == 1 for r in results)  # the same request would be refused again: no retry
    assert "answered 401" in results[0]["error"]
    assert rt.ports.breaker.breaker_state("gpu.audio") == "open"
    audio = Counter(s for (_, _, stage), s in states(rt, "b").items() if stage == "audio")
    assert audio == {"pending": 5, "failed": 1}  # at most threshold - 1 pairs failed; the rest wait


def test_a_rate_limit_longer_than_the_jobs_retries_fails_no_scene(rt, tmp_path, serve) -> None:  # noqa: F811
    """A server over its rate refuses whoever asks, for longer than a job's retries wait (each capped at
    ANIMASTOR_RETRY_BACKOFF_MAX). Old code: the first jobs (up to the breaker's threshold - 1) failed their healthy
    scenes for good while the breaker stayed closed; now every pair goes back to `pending`, and the breaker pauses
    the lane."""
    over_its_rate = b'{"error": {"message": "Rate limit reached for requests", "type": "requests"}}'
    url = serve(answering(429, "application/json", over_its_rate, headers={"Retry-After": "20"}))
    spec = replace(rt.settings.registry.get("audio"), generator="http", endpoint=f"{url}/v1/generate/audio", book_cap=4)
    with_stage(rt, spec, tmp_path, breaker_threshold=3, generate_max_retries=1, retry_backoff_base=0.01,
               retry_backoff_max=0.05)  # fmt: skip
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    results = [run_job(rt.ports, job, worker="test") for job in dispatched_jobs(rt, "b")]
    assert [r["outcome"] for r in results] == ["given_back"] * 4, results
    assert all(r["attempts"] == 2 for r in results)  # retried as a backend failure is
    assert "answered 429: Rate limit reached" in results[0]["error"]
    assert rt.ports.breaker.breaker_state("gpu.audio") == "open"  # the lane pauses
    audio = Counter(s for (_, _, stage), s in states(rt, "b").items() if stage == "audio")
    assert audio == {"pending": 6}
    [command] = rt.ports.commands.commands(book="b")
    assert command.status == "active"


class _Returning:
    """A plugin generator that returns `answer` as it is."""

    name = "returning"

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def generate(self, request: GenerationRequest, should_stop: Callable[[], bool], progress: Any) -> Any:
        return self.answer


@pytest.mark.parametrize(
    "answer",
    [
        None,
        b"RIFF",
        Media("RIFF-as-text", "audio/wav"),  # type: ignore[arg-type]
        Media(b"RIFF", None),  # type: ignore[arg-type]
        Media(bytearray(b"RIFF"), "audio/wav"),
        # A type no HTTP header can carry: S3's client raised a bare ValueError past the verdict at the upload.
        Media(b"RIFF", "audio/wav\r\nX-Injected: 1"),
        Media(b"RIFF", "audio/wäv"),
        Media(b"RIFF", "wav"),
    ],
    ids=["none", "bare-bytes", "text-data", "no-type", "bytearray", "line-break-in-type", "not-ascii", "no-subtype"],
)
def test_a_plugin_that_returns_no_media_fails_its_pair_once_saying_what_it_returned(rt, tmp_path, answer) -> None:
    """A plugin whose `generate` returned text as its data (or no Media at all) raised a TypeError past the
    job's verdict (at the hash, or reading `.data`): a traceback, the pair left `generating` with its start open,
    taken over and run again until its lost starts failed it as `worker_lost`."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    _use_generator(rt, _Returning(answer))
    result = run_job(rt.ports, job, worker="test")
    if isinstance(answer, Media) and isinstance(answer.data, bytearray):
        assert result["outcome"] == "ready", result  # bytes in all but name: taken
        return
    assert result["outcome"] == "failed" and "returned" in result["error"], result
    assert states(rt, "b")[PAIR] == "failed"
    assert len(_events(rt, "job.failed")) == 1


@pytest.mark.parametrize("view", ["items-of-two-bytes", "not-contiguous"])
def test_a_plugin_that_returns_a_memoryview_is_kept_as_its_bytes(rt, tmp_path, view: str) -> None:
    """A memoryview's length counts its items: one of 2-byte samples was kept with half its size (and a local or S3
    store wrote it again on every run, the size never matching); one not contiguous raised `BufferError` at the hash,
    past the verdict, and the pair was left `generating`."""
    wav = synthesize_wav("one two three")
    every_byte_twice = bytes(b for b in wav for _ in "ab")
    data = memoryview(wav).cast("H") if view == "items-of-two-bytes" else memoryview(every_byte_twice)[::2]
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    _use_generator(rt, _Returning(Media(data, "audio/wav")))  # type: ignore[arg-type]
    result = run_job(rt.ports, job, worker="test")
    assert result["outcome"] == "ready", result
    with rt.db.read() as conn:
        [(size,)] = conn.execute("SELECT size_bytes FROM artifacts WHERE book_id = 'b'").fetchall()
    assert size == len(wav)


def test_a_factory_that_says_its_stage_is_misconfigured_is_taken_at_its_word(rt, tmp_path) -> None:
    """A plugin factory raising `GeneratorError(..., misconfigured=True)`, as the docs ask, was wrapped as a
    retryable backend failure: retried `generate_max_retries` times, each with a traceback."""
    result, _ = run_with_a_loader_that_raises(
        rt,
        tmp_path,
        GeneratorError("param 'model' is required", misconfigured=True),
        generate_max_retries=2,
        retry_backoff_base=0.0,
    )
    assert result["attempts"] == 1 and "param 'model' is required" in result["error"], result
    assert rt.redis.client.hget(rt.redis.keys.breaker("gpu.audio"), "failures") == "1"


@pytest.mark.parametrize(
    ("generator", "body"),
    [
        ("http", b"RuntimeError: CUDA error: out of memory"),
        ("http", b""),  # Content-Length: 0
        ("openai-speech", b"RuntimeError: CUDA error: out of memory"),
    ],
    ids=["error-text", "empty", "openai-error-text"],
)
def test_a_server_that_answers_its_error_text_as_the_media_fails_no_more_than_the_breaker_allows(
    rt,
    tmp_path,
    serve,  # noqa: F811
    generator: str,
    body: bytes,
) -> None:
    """A server whose model broke answers every request 200 `audio/wav` with its error text (or nothing): old code
    failed each pair at once as the scene's verdict, all 6 of them, and the breaker never heard of it. A body that is
    no file of the format at all is the server's doing: retried, then counted by the breaker, which pauses the lane."""
    url = serve(answering(200, "audio/wav", body))
    endpoint, params = (f"{url}/v1/generate/audio", {}) if generator == "http" else (f"{url}/v1", {"model": "tts"})
    spec = replace(rt.settings.registry.get("audio"), generator=generator, endpoint=endpoint, params=params, book_cap=6)
    with_stage(rt, spec, tmp_path, breaker_threshold=3, generate_max_retries=1, retry_backoff_base=0.01,
               retry_backoff_max=0.05)  # fmt: skip
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    results = [run_job(rt.ports, job, worker="test", later=Pauses()) for job in dispatched_jobs(rt, "b")]
    assert [r["attempts"] for r in results] == [2] * 6, results  # retried as a backend failure is
    assert rt.ports.breaker.breaker_state("gpu.audio") == "open"
    audio = Counter(s for (_, _, stage), s in states(rt, "b").items() if stage == "audio")
    assert audio == {"failed": 2, "pending": 4}, results  # threshold - 1 failed; the rest wait


def test_the_log_lines_of_a_jobs_refill_carry_none_of_the_jobs_ids(rt, monkeypatch) -> None:
    """Old code: the `[DISPATCH]` line of another book's pair, claimed by the refill of the slot a job freed, carried
    the job's command_id and dispatch id (its task's): a search of the JSON logs by command_id gave another command's
    dispatches (two hunts saw it)."""
    import logging
    from dataclasses import asdict

    from animastor_tasks.worker import logs
    from animastor_tasks.worker.tasks import app

    from .test_elastic_share import lane

    lane(rt, lane_limit=1, book_quota=1, window=1)
    for book in ("b", "other"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
        regenerate_flow.regenerate(rt.ports, book, ["audio"])  # `other` waits for the lane
    [job] = dispatched_jobs(rt, "b")
    monkeypatch.setattr(logs._Lookup, "command_of", classmethod(lambda cls, fields: "the-jobs-command"))
    lines: list[tuple[str, dict[str, str]]] = []

    class Contexts(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append((record.getMessage(), logs.current_context()))

    handler, parent = Contexts(), logging.getLogger("animastor")
    level = parent.level
    parent.addHandler(handler)
    parent.setLevel(logging.INFO)  # clears the loggers' caches of what is enabled
    task = app.tasks["animastor.generate.audio"]
    logs.on_task_prerun(task_id=job.dispatch_id, task=task, kwargs=asdict(job))
    try:
        assert run_job(rt.ports, job, worker="test")["outcome"] == "ready"
    finally:
        logs.on_task_postrun(task_id=job.dispatch_id)
        parent.removeHandler(handler)
        parent.setLevel(level)
    [dispatched] = [context for message, context in lines if message.startswith("[DISPATCH] book='other'")]
    assert dispatched == {}
    [ready] = [context for message, context in lines if message.startswith("[GENERATE]") and " ready " in message]
    assert (ready.get("command_id"), ready.get("dispatch_id")) == ("the-jobs-command", job.dispatch_id)
