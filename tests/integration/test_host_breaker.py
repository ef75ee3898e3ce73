"""One GPU host whose own inference backend is wrong (its per-host API key, its local server down) while the other
hosts' runs succeed: their successes keep the queue's breaker closed, so each worker node keeps a streak of its own
failed runs beside it (lua/breaker_record.lua). Real Postgres and Redis, the jobs run by `run_job` as a GPU
worker's process runs them; the pause itself (the process waiting) is worker/chain.py's: test_chain_shutdown.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from animastor_tasks.adapters.redis.breaker import BreakerStore
from animastor_tasks.dev.inference_server import InferenceServer, make_server
from animastor_tasks.errors import GeneratorError
from animastor_tasks.flow import gate
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.generators import EntryPointGenerators
from animastor_tasks.ports import GenerationRequest, Ports, RunRecorded
from animastor_tasks.worker.wiring import Wiring

from .helpers import Pauses, advertise, make_book, states
from .test_generate import dispatched_jobs, with_stage
from .test_job_troubles import _Generators, _Scripted

THRESHOLD = 3
COOLDOWN = 0.25
QUEUE = "gpu.audio"


@pytest.fixture
def server() -> Iterator[InferenceServer]:
    served = make_server("127.0.0.1", 0, api_key="good-key")
    threading.Thread(target=served.serve_forever, daemon=True).start()
    yield served
    served.shutdown()
    served.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _hosts(
    rt: Wiring, tmp_path: Any, server: InferenceServer, sick: str, *, lane_limit: int = 2
) -> tuple[Ports, Ports]:
    """Host A (`sick`: its key rotated, or its own server down) and host B, which is well."""
    spec = replace(rt.settings.registry.get("audio"), generator="http", endpoint=f"{server.url}/v1/generate/audio")
    spec = replace(spec, lane_limit=lane_limit)
    with_stage(
        rt, spec, tmp_path, retry_backoff_base=0.01, retry_backoff_max=0.02, breaker_threshold=THRESHOLD,
        breaker_cooldown_seconds=COOLDOWN, generate_max_retries=1,
    )  # fmt: skip
    good = replace(rt.ports.settings, inference_api_key="good-key")
    if sick == "wrong-key":
        bad = replace(good, inference_api_key="rotated")
    else:
        spec_a = replace(spec, endpoint=f"http://127.0.0.1:{_closed_port()}/v1/generate/audio")
        stages = tuple(spec_a if s.name == "audio" else s for s in good.registry.stages)
        bad = replace(good, registry=replace(good.registry, stages=stages))
    host_a = replace(rt.ports, settings=bad, generators=EntryPointGenerators(bad))
    return host_a, replace(rt.ports, settings=good, generators=EntryPointGenerators(good))


def _run_all(rt: Wiring, book: str, hosts: dict[str, tuple[Ports, Pauses]]) -> Counter[str]:
    """The hosts take the book's jobs in turn; a host that asked for a pause sits out the next turn."""
    outcomes: Counter[str] = Counter()
    names, turn, resting = sorted(hosts), 0, set()
    for _ in range(300):
        jobs = dispatched_jobs(rt, book)
        if not jobs:
            gate.gate_pass(rt.ports, book)  # the refill a control worker runs for a freed slot
            if not (jobs := dispatched_jobs(rt, book)):
                return outcomes
        for job in jobs:
            name = names[turn % len(names)]
            turn += 1
            if name in resting:
                resting.discard(name)
                name = names[turn % len(names)]
                turn += 1
            ports, later = hosts[name]
            paused = len(later.asked)
            outcomes[f"{name}:{run_job(ports, job, worker=f'audio@gpu-host-{name}#7', later=later)['outcome']}"] += 1
            if len(later.asked) > paused:
                resting.add(name)
    raise AssertionError("jobs never drained")


def _pass(rt: Wiring, book: str) -> None:
    """The pass a control worker makes for a freed slot (its refill) or a tick: the book's capacity deferrals go."""
    rt.redis.client.delete(rt.redis.keys.deferrals(book, "capacity"))
    gate.gate_pass(rt.ports, book)


def _one(rt: Wiring, book: str, name: str, ports: Ports, later: Pauses) -> str:
    """Host `name` runs the book's first dispatched job (the gate passes first when none is)."""
    if not (jobs := dispatched_jobs(rt, book)):
        _pass(rt, book)
        jobs = dispatched_jobs(rt, book)
    assert jobs, "nothing dispatched"
    return str(run_job(ports, jobs[0], worker=f"audio@gpu-host-{name}#7", later=later)["outcome"])


def _half_open(rt: Wiring) -> None:
    """Until the open breaker's cool-down is over (its next dispatch is the lane's test)."""
    deadline = time.monotonic() + 20 * COOLDOWN
    while rt.ports.breaker.breaker_state(QUEUE) == "open":
        assert time.monotonic() < deadline, "the breaker never went half-open"
        time.sleep(0.02)


def _drain(rt: Wiring, book: str, name: str, ports: Ports, later: Pauses) -> None:
    """Host `name` runs the book's jobs until none is left, a pair deferred past a failed test included."""
    deadline = time.monotonic() + 40 * COOLDOWN
    while {"pending", "generating"} & {state for pair, state in states(rt, book).items() if pair[2] == "audio"}:
        assert time.monotonic() < deadline, states(rt, book)
        if not dispatched_jobs(rt, book):
            _pass(rt, book)
        if jobs := dispatched_jobs(rt, book):
            assert run_job(ports, jobs[0], worker=f"audio@gpu-host-{name}#7", later=later)["outcome"] == "ready"
        else:
            time.sleep(0.02)  # a deferral's end


def _scripted(rt: Wiring, tmp_path: Any, fail: BaseException | None) -> Ports:
    """A host whose every run raises `fail` (None: a host whose runs succeed); the lane runs one job at a time."""
    spec = replace(rt.settings.registry.get("audio"), lane_limit=1)
    with_stage(
        rt, spec, tmp_path, retry_backoff_base=0.01, retry_backoff_max=0.02, breaker_threshold=THRESHOLD,
        breaker_cooldown_seconds=COOLDOWN, generate_max_retries=1,
    )  # fmt: skip

    def run(request: GenerationRequest, progress: Any) -> None:
        if fail is not None:
            raise fail

    return replace(rt.ports, generators=_Generators(_Scripted(run)))


def _streak(rt: Wiring, name: str) -> int:
    return int(rt.redis.client.get(rt.redis.keys.breaker_host(QUEUE, f"audio@gpu-host-{name}")) or 0)


def test_a_sick_host_that_opens_the_breaker_pauses_and_so_does_its_failed_half_open_test(
    rt: Wiring, tmp_path: Any, server: InferenceServer
) -> None:
    """A host that fails fast (a 401, no retry) is idle first: its failures alone reach the threshold before any well
    host's success, and open the queue's breaker. Before, `open` (and `reopened`) paused nobody: the sick host, idle,
    took the half-open test at each cool-down, failed it, and the whole lane waited another cool-down on every host."""
    host_a, host_b = _hosts(rt, tmp_path, server, "wrong-key", lane_limit=1)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, QUEUE)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    a, b = Pauses(), Pauses()
    runs = [_one(rt, "b", "A", host_a, a) for _ in range(THRESHOLD)]
    assert runs == ["failed"] * (THRESHOLD - 1) + ["given_back"]
    assert rt.ports.breaker.breaker_state(QUEUE) == "open"
    assert a.asked == [COOLDOWN]  # the breaker opened, and the node that opened it pauses too
    _half_open(rt)
    assert _one(rt, "b", "A", host_a, a) == "given_back"  # the test, had the sick host taken it: reopened
    assert rt.ports.breaker.breaker_state(QUEUE) == "open"
    assert a.asked == [COOLDOWN] * 2  # paused again: the next test goes to another host
    _half_open(rt)
    assert _one(rt, "b", "B", host_b, b) == "ready"  # a well host's test closes it
    _drain(rt, "b", "B", host_b, b)
    found = Counter(state for (_, _, stage), state in states(rt, "b").items() if stage == "audio")
    assert found == {"failed": THRESHOLD - 1, "ready": 6 - (THRESHOLD - 1)}
    assert b.asked == [] and _streak(rt, "A") == THRESHOLD + 1 and _streak(rt, "B") == 0
    rt.ports.counters.flush()  # type: ignore[attr-defined]
    assert rt.redis.client.hget(rt.redis.keys.metrics(), "job:host_paused:audio") == "2"


def test_a_well_host_whose_failure_opens_the_breaker_does_not_pause(rt: Wiring, tmp_path: Any) -> None:
    """The failure that opens (or reopens) the breaker is a well host's, its own streak below the threshold: it takes
    the lane's next test once the cool-down is over, as before. The sick host pauses once its own streak reaches it."""
    host_a = _scripted(rt, tmp_path, GeneratorError("401 unauthorized", misconfigured=True))
    host_b = _scripted(rt, tmp_path, GeneratorError("503 from the shared backend", retryable=True))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, QUEUE)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    a, b = Pauses(), Pauses()
    assert [_one(rt, "b", "A", host_a, a) for _ in range(THRESHOLD - 1)] == ["failed"] * (THRESHOLD - 1)
    assert _one(rt, "b", "B", host_b, b) == "given_back"  # the threshold's failure, and B's first: open
    assert rt.ports.breaker.breaker_state(QUEUE) == "open"
    assert a.asked == b.asked == [] and (_streak(rt, "A"), _streak(rt, "B")) == (THRESHOLD - 1, 1)
    _half_open(rt)
    assert _one(rt, "b", "B", host_b, b) == "given_back"  # B's test fails too: reopened, B's streak at 2
    assert b.asked == []
    _half_open(rt)
    assert _one(rt, "b", "A", host_a, a) == "given_back"  # A's test: reopened, A's streak at the threshold
    assert a.asked == [COOLDOWN] and b.asked == []


def test_a_rate_limit_counts_against_the_queue_not_the_host(rt: Wiring, tmp_path: Any) -> None:
    """A 429 is the backend's word to whoever asks (a limit the farm shares): it feeds the queue's breaker but no
    node's streak. Before, a host that met it a threshold of runs in a row while other hosts got through was told
    `host`, paused, and blamed (`AnimastorHostPaused`: "fix that host's key")."""
    host_a = _scripted(rt, tmp_path, GeneratorError("429 too many requests", rate_limited=True))
    host_b = _scripted(rt, tmp_path, None)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=6))
    advertise(rt, QUEUE)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    a, b = Pauses(), Pauses()
    for _ in range(THRESHOLD + 1):
        assert _one(rt, "b", "A", host_a, a) == "given_back"
        assert _one(rt, "b", "B", host_b, b) == "ready"
    assert a.asked == [] and _streak(rt, "A") == 0
    assert rt.ports.breaker.breaker_state(QUEUE) == "closed"


@pytest.mark.parametrize("sick", ["wrong-key", "server-down"])
def test_a_host_whose_own_backend_fails_fails_at_most_threshold_less_one_pairs_and_pauses(
    rt: Wiring, tmp_path: Any, server: InferenceServer, sick: str
) -> None:
    """Before, the other host's successes kept the breaker closed and every pair the sick host took failed for good
    (20 of 40); a host that fails fast is idle first and took most of the lane's jobs."""
    host_a, host_b = _hosts(rt, tmp_path, server, sick)
    rt.catalog.import_book(make_book("b", chapters=2, scenes=8))
    advertise(rt, QUEUE)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    a, b = Pauses(), Pauses()
    outcomes = _run_all(rt, "b", {"A": (host_a, a), "B": (host_b, b)})

    found = Counter(state for (_, _, stage), state in states(rt, "b").items() if stage == "audio")
    assert found == {"failed": THRESHOLD - 1, "ready": 16 - (THRESHOLD - 1)}, outcomes
    assert outcomes["A:ready"] == 0 and outcomes["A:given_back"] >= 1 and outcomes["B:failed"] == 0, outcomes
    # Every give-back of the sick host paused its process for a breaker cool-down; the well host never paused.
    assert a.asked == [COOLDOWN] * outcomes["A:given_back"] and b.asked == []
    rt.ports.counters.flush()  # type: ignore[attr-defined]
    assert rt.redis.client.hget(rt.redis.keys.metrics(), "job:host_paused:audio") == str(len(a.asked))
    assert rt.ports.breaker.breaker_state(QUEUE) == "closed"  # the queue's breaker never opened: B was well
    streak = rt.redis.client.get(rt.redis.keys.breaker_host(QUEUE, "audio@gpu-host-A"))
    assert int(streak or 0) == THRESHOLD - 1 + outcomes["A:given_back"]
    assert not rt.redis.client.exists(rt.redis.keys.breaker_host(QUEUE, "audio@gpu-host-B"))


def test_a_scene_that_fails_on_every_host_still_fails(rt: Wiring, tmp_path: Any) -> None:
    """The hosts' successes on the other scenes end their streaks: the backend's failure on that one scene is the
    scene's, and it fails once, with no host paused."""

    def poison(request: GenerationRequest, progress: Any) -> None:
        if request.scene_id == "s3":
            raise GeneratorError("500 on this text", retryable=True)

    with_stage(
        rt, rt.settings.registry.get("audio"), tmp_path, retry_backoff_base=0.01, retry_backoff_max=0.02,
        breaker_threshold=THRESHOLD, breaker_cooldown_seconds=COOLDOWN, generate_max_retries=1,
    )  # fmt: skip
    rt.ports = replace(rt.ports, generators=_Generators(_Scripted(poison)))
    rt.catalog.import_book(make_book("b", chapters=2, scenes=6))
    advertise(rt, QUEUE)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    a, b = Pauses(), Pauses()
    outcomes = _run_all(rt, "b", {"A": (rt.ports, a), "B": (rt.ports, b)})
    found = {pair: state for pair, state in states(rt, "b").items() if pair[2] == "audio"}
    assert {pair: state for pair, state in found.items() if state != "ready"} == {
        ("ch1", "s3", "audio"): "failed",
        ("ch2", "s3", "audio"): "failed",
    }, outcomes
    assert a.asked == b.asked == []


def test_a_nodes_streak_counts_its_own_failed_runs_and_ends_with_its_success(rt: Wiring) -> None:
    """Through the adapter: the queue's breaker answers `host` once the node has failed its last `threshold` runs
    while other nodes' successes keep the breaker closed; the node's success ends its streak, which lapses a day
    after its last failure (a node gone for good leaves nothing behind). A publish touches no streak, nor a run
    recorded without its node."""
    breaker: BreakerStore = rt.ports.breaker  # type: ignore[assignment]

    def run(node: str | None, ok: bool) -> tuple[str | None, int]:
        recorded = breaker.breaker_record_run(QUEUE, ok, 3, 30, node)
        return recorded.state, recorded.streak

    assert [run("a@h1", False), run("b@h2", True), run("a@h1", False)] == [("closed", 1), ("closed", 0), ("closed", 2)]
    assert run(None, False) == ("closed", 0) and run("b@h2", True) == ("closed", 0)  # a run without its node
    assert run("a@h1", False) == ("host", 3)  # its third failure in a row, the breaker still closed
    key = rt.redis.keys.breaker_host(QUEUE, "a@h1")
    assert 86000 < rt.redis.client.ttl(key) <= 86400
    assert breaker.breaker_record(QUEUE, True, 3, 30) == "closed"  # a publish's success says nothing of a host
    assert run("b@h2", True) == ("closed", 0) and run("a@h1", False) == ("host", 4)  # still failing: its test failed
    assert run("a@h1", True) == ("closed", 0) and not rt.redis.client.exists(key)  # it runs well again
    assert run("a@h1", False) == ("closed", 1)
    # Failures of one node alone open the queue's breaker as before (open outranks `host`), its streak told beside.
    assert [run("a@h1", False), run("a@h1", False)] == [("closed", 2), ("open", 3)]
    assert run("a@h1", False) == ("reopened", 4) and run("b@h2", False) == ("reopened", 1)
    assert breaker.breaker_record_run(QUEUE, False, 3, 30, None) == RunRecorded("reopened")  # counted on no node
