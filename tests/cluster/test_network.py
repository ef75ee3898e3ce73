"""Issue 18 across hosts, on both brokers: a queued job keeps its lease, an expired lease is taken over within a
tick, a worker outlives a partition, dead consumers are not counted, a host loss restarts only its own jobs,
and a GPU worker drains on SIGTERM.

The hosts are network namespaces (tests/support/netns.py): a partition sets a host's link down, a heal sets it
up, a host loss SIGKILLs every process of its namespace. Reconcile runs every 30 s here (its default), so
nothing below can be the reconcile pass's doing: what these tests measure is the tick's. Each test appends its
figures to test-output/cluster-figures.jsonl.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tests.cluster.test_many_hosts import busy, new_book, outcome, since, start
from tests.e2e.harness import audio_stage, image_stage, stage_table
from tests.faults.scale import current as current_scale
from tests.support import wait_for
from tests.support.cluster import Proc
from tests.support.netns_cluster import ManyHosts

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

LEASE = 4
PRESENCE_TTL = 3.0
TICK = 1.0
RECONCILE = 30  # the default: takeover must not wait for it
CODE = os.environ.get("ANIMASTOR_FIGURES_CODE", "working tree")  # say which code ran (before/after figures)


def stages(job_seconds: float, *, slots: int = 8, lease: int = LEASE) -> str:
    job = {"steps": 10, "step_seconds": job_seconds / 10}
    limits = {"lane_limit": slots, "book_quota": slots, "window": slots}
    return stage_table(audio=audio_stage(), image=image_stage(params=job, lease_ttl=lease, **limits))


def cluster(make_cluster: Any, job_seconds: float, **kw: Any) -> ManyHosts:
    return make_cluster(stages=stages(job_seconds, **kw), reconcile_seconds=RECONCILE)


def report(cl: ManyHosts, **figures: Any) -> None:
    cl.report(code=CODE, **figures)


def starts_on(proc: Proc) -> list[str]:
    return [line.split("dispatch=", 1)[1].split()[0] for line in proc.log().splitlines() if " started on " in line]


def lease_lost(procs: list[Proc]) -> int:
    return sum(p.log().count("stopping: lease lost") for p in procs)


def completed(cl: ManyHosts, book: str, timeout: float) -> Any:
    return cl.stack.wait_commands(book, ["image"], "completed", timeout=timeout)


def test_a_backlog_longer_than_the_lease_is_started_once_per_pair(make_cluster: Any, broker: str) -> None:
    """10 jobs of 1.5 s on two hosts: the last ones wait ~6 s in the queue, 1.5 lease TTLs."""
    cl = cluster(make_cluster, 1.5, lease=LEASE)
    gpus = start(cl)
    pairs = new_book(cl, "backlog", 10)
    began = time.monotonic()
    cl.stack.client.regenerate("backlog", ["image"])
    completed(cl, "backlog", 90)
    started = cl.starts("backlog")
    figures = {
        "pairs": len(pairs),
        "starts": len(started),
        "starts_per_pair": round(len(started) / len(pairs), 2),
        "lease_lost_stops": lease_lost(list(gpus.values())),
        "leases_expired": len(cl.stack.events("lease.expired", "backlog")),
        "dispatches": len(cl.stack.events("dispatch", "backlog")),
        "seconds": since(began),
    }
    report(cl, **figures)
    cl.check_artifacts("backlog", pairs)
    assert figures["lease_lost_stops"] == 0 and figures["leases_expired"] == 0, figures
    assert figures["starts_per_pair"] == 1.0, figures


def test_a_cut_off_hosts_pair_is_taken_over_within_the_lease(make_cluster: Any, broker: str) -> None:
    cl = cluster(make_cluster, 12.0)
    gpus = start(cl, ("gpu1",))
    pairs = new_book(cl, "takeover", 1)
    cl.stack.client.regenerate("takeover", ["image"])
    dispatch_id = busy(gpus["gpu1"])
    gpu2 = cl.host("gpu2").gpu("image", args=["--without-mingle"])
    cut = cl.partition("gpu1")
    before = len(starts_on(gpus["gpu1"]))
    wait_for(lambda: starts_on(gpu2), LEASE + 10, what="the pair restarted on gpu2", interval=0.05)
    takeover_s = since(cut)
    restarted_on_cut_host = len(starts_on(gpus["gpu1"])) - before
    cl.heal("gpu1")
    completed(cl, "takeover", 60)
    cl.check_artifacts("takeover", pairs)
    report(cl, takeover_s=takeover_s, lease_ttl=LEASE, tick_s=TICK, restarted_on_cut_host=restarted_on_cut_host)
    assert restarted_on_cut_host == 0
    assert takeover_s <= LEASE + 2, f"taken over {takeover_s}s after the cut"
    assert dispatch_id not in {r["dispatch_id"] for r in cl.stack.artifacts("takeover")}


# `make test` cuts for 30 s; ANIMASTOR_FAULT_SCALE=long (`make faults`) adds a 5 s cut (shorter than the broker
# heartbeat's detection) and a 120 s one, which alone would take a fifth of the suite's time budget.
@pytest.mark.parametrize("cut_seconds", current_scale().pick([30], [5, 30, 120]))
def test_a_worker_outlives_a_partition(make_cluster: Any, broker: str, cut_seconds: int) -> None:
    cl = cluster(make_cluster, 1.0)
    gpus = start(cl, ("gpu1",))
    proc = gpus["gpu1"]
    pid = proc.pid
    new_book(cl, "rejoin", 1)
    cl.partition("gpu1")
    time.sleep(cut_seconds)
    healed = cl.heal("gpu1")
    rejoined = wait_for(lambda: (proc.alive() and cl.live(proc)) or not proc.alive(), 60, what="rejoin", interval=0.1)
    rejoin_s = since(healed)
    assert rejoined and proc.alive(), f"the worker exited ({proc.popen.returncode}):\n{proc.tail(30)}"
    cl.stack.client.regenerate("rejoin", ["image"])
    wait_for(lambda: starts_on(proc), 30, what="a job started on the rejoined worker", interval=0.05)
    take_s = since(healed)
    critical = [line for line in proc.log().splitlines() if "CRITICAL" in line or "Unrecoverable" in line]
    completed(cl, "rejoin", 30)
    report(cl, cut_s=cut_seconds, rejoin_s=rejoin_s, takes_work_s=take_s, same_pid=proc.pid == pid, critical=critical)
    assert proc.pid == pid and proc.alive()
    assert critical == [], critical
    assert take_s <= 5, f"took work {take_s}s after the heal"


@pytest.mark.parametrize("fault", ["cut", "kill"])
def test_a_stage_without_live_workers_blocks_within_a_presence_ttl(make_cluster: Any, broker: str, fault: str) -> None:
    """Old code on RabbitMQ: the broker still counted the cut-off worker's half-open connection, and only the
    30 s reconcile pass looked at stages whose jobs were all running."""
    cl = make_cluster(stages=stages(30.0, lease=60), reconcile_seconds=RECONCILE)
    gpus = start(cl, ("gpu1",))
    new_book(cl, "blocked", 2)
    cl.stack.client.regenerate("blocked", ["image"])
    busy(gpus["gpu1"])
    began = cl.partition("gpu1") if fault == "cut" else cl.lose("gpu1")

    def blocked() -> bool:
        row = cl.stack.commands("blocked")["image"]
        return bool(row.status == "blocked" and row.reason == "no_worker:image")

    try:
        wait_for(blocked, 60, what="the image command blocked", interval=0.05)
        block_s = since(began)
    finally:
        cl.heal("gpu1")
    bound = PRESENCE_TTL + TICK + 1.5  # + the last heartbeat's age (TTL/3) is inside the TTL; polling slack
    report(cl, fault=fault, block_s=block_s, bound_s=bound)
    assert block_s <= bound, f"blocked {block_s}s after the {fault}"


def test_a_host_loss_restarts_only_the_jobs_it_ran(make_cluster: Any, broker: str) -> None:
    cl = cluster(make_cluster, 2.0)
    gpus = start(cl)
    pairs = new_book(cl, "lost", 8)
    cl.stack.client.regenerate("lost", ["image"])
    busy(gpus["gpu1"])
    running = {d for d in starts_on(gpus["gpu1"]) if f"dispatch={d}" not in _ended(gpus["gpu1"])}
    cl.lose("gpu1")
    completed(cl, "lost", 120)
    started = cl.starts("lost")
    cl.check_artifacts("lost", pairs)
    report(cl, pairs=len(pairs), running_on_lost=len(running), starts=len(started))
    assert len(started) <= len(pairs) + len(running), (len(started), len(pairs), running)


def _ended(proc: Proc) -> str:
    ends = ("fence_rejected", "stopping:", " ready sha256=", "failed after", "failed without")
    return "\n".join(line for line in proc.log().splitlines() if any(e in line for e in ends))


def test_a_gpu_worker_drains_on_sigterm(make_cluster: Any, broker: str) -> None:
    """Warm shutdown: the worker stops consuming, finishes the job it runs (committed), and exits; the other
    host does the rest."""
    cl = cluster(make_cluster, 3.0, slots=2)
    gpus = start(cl)
    pairs = new_book(cl, "drain", 4)
    cl.stack.client.regenerate("drain", ["image"])
    dispatch_id = busy(gpus["gpu1"])
    proc = gpus["gpu1"]
    cl.host("gpu1").send_signal(proc, signal.SIGTERM, group=False)
    signalled = time.monotonic()
    ended = outcome(proc, dispatch_id, 15)
    proc.popen.wait(timeout=20)
    exit_s = since(signalled)
    after = starts_on(proc)[starts_on(proc).index(dispatch_id) + 1 :]
    completed(cl, "drain", 60)
    cl.check_artifacts("drain", pairs)
    report(cl, drain_exit_s=exit_s, exit_code=proc.popen.returncode, started_after_sigterm=len(after))
    assert " ready sha256=" in ended, ended
    assert dispatch_id in {r["dispatch_id"] for r in cl.stack.artifacts("drain")}
    assert proc.popen.returncode == 0 and after == []
