"""Issue 11, item 3: faults between hosts, on both brokers, with GPU workers on hosts of their own.

A control host runs Postgres, Redis, RabbitMQ, the S3 server, the control worker and beat; two GPU hosts each
run one image worker; every host is a network namespace (tests/support/netns.py). A partition sets a host's
link down, a heal sets it up, a host loss SIGKILLs every process of its namespace. Each test appends its
figures (detection, re-dispatch, lost, double commits, starts after cancel) to
test-output/cluster-figures.jsonl and prints them.

Settings are short so that each fault plays out in seconds: lease 4 s, presence TTL 3 s, tick 1 s and (until
issue 18 makes takeover prompt) a reconcile pass every 2 s; 2.5 s jobs; lane and book quota 2, one job per
worker, so nothing waits queued long enough to lose its lease (issue 18, item 1).
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from animastor_tasks.flow.lanes import HEARTBEAT_SLACK
from tests.e2e.harness import audio_stage, image_stage, running_dispatch, stage_table
from tests.faults.checks import duplicated_commits, unauthorized_dispatches
from tests.integration.helpers import make_book
from tests.support import wait_for
from tests.support.cluster import Proc
from tests.support.netns_cluster import ManyHosts

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(150)]

LEASE = 4
JOB = {"steps": 10, "step_seconds": 0.25}  # 2.5 s per image
STAGES = stage_table(audio=audio_stage(), image=image_stage(params=JOB, lease_ttl=LEASE, lane_limit=2, book_quota=2))
Pair = tuple[str, str, str]


def start(cl: ManyHosts, gpu_hosts: tuple[str, ...] = ("gpu1", "gpu2")) -> dict[str, Proc]:
    """Control worker and beat on `ctl`, one image worker per GPU host (all starting at once); by host name."""
    ctl = cl.host("ctl")
    control, beat = ctl.control(wait=False), ctl.beat(wait=False)
    gpus = {name: cl.host(name).gpu("image", wait=False, args=["--without-mingle"]) for name in gpu_hosts}
    ctl.wait_ready(control, beat)
    for name, proc in gpus.items():
        cl.host(name).wait_ready(proc)
    return gpus


def new_book(cl: ManyHosts, book_id: str, scenes: int) -> set[Pair]:
    book = make_book(book_id, chapters=1, scenes=scenes)
    cl.stack.rt.catalog.import_book(book)
    return {pair for pair in cl.stack.states(book_id) if pair[2] == "image"}


def pair_of(cl: ManyHosts, book: str, dispatch_id: str) -> Pair:
    found = [(e["chapter_id"], e["scene_id"], e["stage"]) for e in cl.stack.events("dispatch", book)]
    ids = [e["dispatch_id"] for e in cl.stack.events("dispatch", book)]
    return found[ids.index(dispatch_id)]


def busy(proc: Proc, timeout: float = 30) -> str:
    """The dispatch id `proc` runs now, once it runs one and is 0.3 s into it."""
    dispatch_id = str(wait_for(lambda: running_dispatch(proc), timeout, what=f"a job running on {proc.name}"))
    time.sleep(0.3)
    return dispatch_id


def outcome(proc: Proc, dispatch_id: str, timeout: float) -> str:
    """The line in which `proc` ended the job `dispatch_id` (refused, stopped, failed or ready)."""
    ends = ("fence_rejected", "stopping:", " ready sha256=", "failed after", "failed without")

    def ended() -> str | None:
        for line in proc.log().splitlines():
            if f"dispatch={dispatch_id}" in line and any(e in line for e in ends):
                return line
        return None

    return str(wait_for(ended, timeout, what=f"the end of job {dispatch_id} in {proc.name}'s log", interval=0.2))


def ending(line: str) -> str:
    """What a job's last log line says, without its identifiers: `stopping: lease lost`, `fence_rejected: …`."""
    return re.sub(r" command_id=\S+$", "", re.split(r" token=\d+ ", line, maxsplit=1)[-1]).strip()


def since(t0: float) -> float:
    return round(time.monotonic() - t0, 2)


def rejoin(cl: ManyHosts, proc: Proc, healed: float, timeout: float = 30) -> float | None:
    """Seconds from the heal until the same worker process advertises again; None if it did not (or died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.alive():
        if cl.live(proc):
            return since(healed)
        time.sleep(0.1)
    return None


def no_double_commits(cl: ManyHosts, book: str, dead: set[str]) -> None:
    assert duplicated_commits(cl.stack, book) == {}
    committed = {r[0] for r in cl.stack.query("SELECT dispatch_id FROM artifacts WHERE book_id = %s", (book,))}
    ready = {e["dispatch_id"] for e in cl.stack.events("job.ready", book)}
    assert not dead & (committed | ready), f"a cut-off or cancelled job committed: {dead & (committed | ready)}"
    assert unauthorized_dispatches(cl.stack, book) == []


def test_gpu_host_partitioned_mid_job_while_another_serves_the_queue(make_cluster: Any, broker: str) -> None:
    cl = make_cluster(stages=STAGES)
    ttl, settings = cl.settings.presence_ttl_seconds, cl.settings
    gpus = start(cl)
    pairs = new_book(cl, "cut-one", scenes=4)
    began = time.monotonic()
    cl.stack.client.regenerate("cut-one", ["image"])
    victim, other = gpus["gpu1"], gpus["gpu2"]
    first = busy(victim)
    pair = pair_of(cl, "cut-one", first)

    cut = cl.partition("gpu1")
    wait_for(lambda: not cl.live(victim), ttl + 3, what="gpu1's worker leaves presence", interval=0.05)
    detected = since(cut)

    def restarted() -> list[dict[str, Any]]:
        return [
            e
            for e in cl.starts("cut-one")
            if (e["chapter_id"], e["scene_id"]) == pair[:2] and e["dispatch_id"] != first
        ]

    again = wait_for(restarted, LEASE + settings.reconcile_seconds + 15, what=f"{pair} started again", interval=0.1)
    redispatched = since(cut)
    # Its start line is written just after the journal's start commits: waited for, never read at once.
    restarted_on = f"dispatch={again[0]['dispatch_id']}"
    wait_for(lambda: restarted_on in other.log(), 10, what="the pair restarted on gpu2 (its start line)")
    cl.stack.wait_commands("cut-one", ["image"], "completed", timeout=60)
    completed = since(began)

    healed = cl.heal("gpu1")
    end = outcome(victim, first, timeout=45)
    rejoined = rejoin(cl, victim, healed)
    cl.check_artifacts("cut-one", pairs)
    no_double_commits(cl, "cut-one", {first})
    starts = len(cl.starts("cut-one"))
    cl.report(
        pairs=len(pairs),
        detection_s=detected,
        redispatch_s=redispatched,
        completed_s=completed,
        first_job_end=ending(end),
        rejoin_s=rejoined,
        starts=starts,
        lost=0,
        double_commits=0,
    )
    assert detected <= ttl + 1.0, f"presence expired {detected}s after the cut (TTL {ttl}s)"
    bound = LEASE + settings.reconcile_seconds + 2 * settings.tick_seconds + 1.0
    assert redispatched <= bound, f"re-dispatched {redispatched}s after the cut, more than {bound}s"
    # Fenced, either way: its commit refused by the token, or (the builtin generator reports progress to Redis
    # at every step, so a cut-off job cannot finish before the heal) stopped by its watcher, which finds the
    # lease held by the newer dispatch, before it gets to commit.
    fenced = ("fence_rejected" in end and "stale" in end) or "stopping: lease lost" in end
    assert fenced, f"the cut-off job was not fenced off: {end}"


def test_every_host_of_a_stage_partitioned(make_cluster: Any, broker: str) -> None:
    cl = make_cluster(stages=STAGES)
    ttl, settings = cl.settings.presence_ttl_seconds, cl.settings
    gpus = start(cl)
    running_pairs = new_book(cl, "cut-all-a", scenes=4)
    later_pairs = new_book(cl, "cut-all-b", scenes=2)
    cl.stack.client.regenerate("cut-all-a", ["image"])
    inflight = {busy(proc) for proc in gpus.values()}

    cut = cl.partition("gpu1")
    cl.partition("gpu2")
    cl.stack.client.regenerate("cut-all-b", ["image"])

    def blocked(book: str) -> Any:
        row = cl.stack.commands(book).get("image")
        return row if row is not None and row.status == "blocked" else None

    limit = ttl + settings.tick_seconds + 0.5 + ttl / 3 + HEARTBEAT_SLACK  # and the second count of its consumers
    row = wait_for(lambda: blocked("cut-all-a"), limit + 10, what="the running command BLOCKED", interval=0.05)
    running_blocked_s = since(cut)
    assert row.reason == "no_worker:image"
    try:
        row = wait_for(
            lambda: blocked("cut-all-b"), max(0.5, limit + ttl / 3 + 5 - since(cut)), what="the new command BLOCKED"
        )
    except AssertionError as err:
        kinds = sorted(
            {
                e["kind"]
                for e in cl.stack.query("SELECT DISTINCT kind FROM events WHERE book_id = 'cut-all-b'")
                for e in [{"kind": e[0]}]
            }
        )
        states = sorted(set(cl.stack.states("cut-all-b").values()))
        row = cl.stack.commands("cut-all-b")["image"]
        kinds.extend(k for k in cl.stack.rt.redis.client.keys("*") if "cut-all-b" in str(k))
        cl.report(running_blocked_s=running_blocked_s, new_blocked_s=None, new_command=(row.status, row.reason))
        raise AssertionError(
            f"{err}: the new command is {row.status} ({row.reason}), its pairs {states}, its events {kinds}"
        ) from None
    blocked_s = since(cut)
    assert row.reason == "no_worker:image"

    def released() -> bool:
        states = cl.stack.states("cut-all-a")
        return not any(states[p] == "generating" for p in running_pairs)

    wait_for(released, LEASE + settings.reconcile_seconds + 15, what="in-flight pairs released", interval=0.1)
    released_s = since(cut)
    states_a = {cl.stack.states("cut-all-a")[p] for p in running_pairs}
    assert states_a <= {"pending", "dirty", "ready"}, states_a

    healed = cl.heal("gpu1")
    cl.heal("gpu2")
    rejoined = {name: rejoin(cl, proc, healed) for name, proc in gpus.items()}
    assert any(v is not None for v in rejoined.values()), f"no image worker came back after the heal: {rejoined}"
    # A heartbeat can be back before the consumer has reconnected to the broker: a command sent in that
    # moment is BLOCKED (no consumer yet), so the new command goes one presence TTL after the rejoin.
    time.sleep(ttl)
    again = time.monotonic()
    cl.stack.client.regenerate("cut-all-b", ["image"])
    cl.stack.wait_commands("cut-all-b", ["image"], "completed", timeout=60)
    rerun = since(again)
    cl.check_artifacts("cut-all-b", later_pairs)
    no_double_commits(cl, "cut-all-a", inflight)
    no_double_commits(cl, "cut-all-b", set())
    cl.report(
        running_blocked_s=running_blocked_s,
        new_blocked_s=blocked_s,
        released_s=released_s,
        states_after_release=sorted(states_a),
        rejoin_s=rejoined,
        new_command_completed_s=rerun,
        lost=0,
        double_commits=0,
    )
    assert running_blocked_s <= limit, f"the running command BLOCKED {running_blocked_s}s after the cut"
    # The new command's pairs are pending, not running: its own pass blocks it, after the tick's takeover has
    # counted the stage's consumers twice for the running command, and counts them twice as well (one more
    # TTL/3 + slack: measured 5.84-5.98 s against 6.0 s alone, 6.02 s once in a loaded CI run).
    assert blocked_s <= limit + ttl / 3 + HEARTBEAT_SLACK, f"the new command BLOCKED {blocked_s}s after the cut"
    bound = LEASE + settings.reconcile_seconds + 2 * settings.tick_seconds + 1.0
    assert released_s <= bound, f"in-flight pairs released {released_s}s after the cut, more than {bound}s"


def test_gpu_host_lost_for_good(make_cluster: Any, broker: str) -> None:
    cl = make_cluster(stages=STAGES)
    ttl, settings = cl.settings.presence_ttl_seconds, cl.settings
    gpus = start(cl)
    pairs = new_book(cl, "lost-host", scenes=4)
    began = time.monotonic()
    cl.stack.client.regenerate("lost-host", ["image"])
    first = busy(gpus["gpu1"])
    pair = pair_of(cl, "lost-host", first)

    lost = cl.lose("gpu1")
    assert cl.network.pids(cl.network.hosts["gpu1"]) == []
    wait_for(lambda: not cl.live(gpus["gpu1"]), ttl + 3, what="the lost worker leaves presence", interval=0.05)
    detected = since(lost)

    def restarted() -> list[dict[str, Any]]:
        return [
            e
            for e in cl.starts("lost-host")
            if (e["chapter_id"], e["scene_id"]) == pair[:2] and e["dispatch_id"] != first
        ]

    wait_for(restarted, LEASE + settings.reconcile_seconds + 15, what=f"{pair} started again", interval=0.1)
    redispatched = since(lost)
    cl.stack.wait_commands("lost-host", ["image"], "completed", timeout=60)
    completed = since(began)
    cl.check_artifacts("lost-host", pairs)
    no_double_commits(cl, "lost-host", {first})
    states = set(cl.stack.states("lost-host").values()) - {"dirty"}  # the audio stage was never commanded
    starts = len(cl.starts("lost-host"))
    cl.report(
        pairs=len(pairs),
        detection_s=detected,
        redispatch_s=redispatched,
        completed_s=completed,
        starts=starts,
        lost=0,
        double_commits=0,
    )
    assert states == {"ready"}, states
    assert detected <= ttl + 1.0
    bound = LEASE + settings.reconcile_seconds + 2 * settings.tick_seconds + 1.0
    assert redispatched <= bound, f"re-dispatched {redispatched}s after the loss, more than {bound}s"


def test_stop_all_while_a_gpu_host_is_partitioned(make_cluster: Any, broker: str) -> None:
    cl = make_cluster(stages=STAGES)
    settings = cl.settings
    gpus = start(cl)
    new_book(cl, "stop-cut", scenes=6)
    cl.stack.client.regenerate("stop-cut", ["image"])
    victim = gpus["gpu1"]
    first = busy(victim)

    cut = cl.partition("gpu1")
    time.sleep(0.5)
    cl.stack.client.cancel("stop-cut", reason="Stop All while gpu1 is cut off")
    cancelled_at = cl.stack.db_now()
    cancel_s = since(cut)
    started_lines = {name: proc.log().count(" started on ") for name, proc in gpus.items()}
    time.sleep(1.0)
    healed = cl.heal("gpu1")
    end = outcome(victim, first, timeout=45)
    rejoined = rejoin(cl, victim, healed)
    time.sleep(2 * settings.tick_seconds + settings.reconcile_seconds + 1)  # anything that would start, has

    late_events = cl.starts("stop-cut", after=cancelled_at)
    late_lines = {name: proc.log().count(" started on ") - started_lines[name] for name, proc in gpus.items()}
    states = set(cl.stack.states("stop-cut").values())
    cl.report(
        cancel_after_cut_s=cancel_s,
        partitioned_job_end=ending(end),
        rejoin_s=rejoined,
        starts_after_cancel=len(late_events) + sum(late_lines.values()),
        states=sorted(states),
        double_commits=len(duplicated_commits(cl.stack, "stop-cut")),
    )
    assert late_events == [], f"jobs started after the cancel: {late_events}"
    assert late_lines == dict.fromkeys(gpus, 0), f"job starts logged after the cancel: {late_lines}"
    assert not {"pending", "generating"} & states, states
    no_double_commits(cl, "stop-cut", {first})
