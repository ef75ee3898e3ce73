"""A host's own trouble with a queue: the breaker's record of its runs, and the pauses of its process.

A host whose runs keep failing while other hosts' succeed (its API key, its local inference server), or that
cannot reach Postgres while the others can, must not take the queue's jobs from the hosts that could run them:
its process pauses, and the pairs it gave back run elsewhere meanwhile.
"""

from __future__ import annotations

import logging
from typing import Any

from animastor_tasks.domain.job_rules import ErrorKind, breaker_feed, host_pause, node_feed
from animastor_tasks.domain.liveness import holder_node
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow.job import Later, quietly
from animastor_tasks.ports import Ports, RunRecorded

log = logging.getLogger("animastor.generate")


def record_breaker(ports: Ports, queue: str, kind: ErrorKind | None, worker: str) -> RunRecorded:
    """Feed the queue's breaker, and the streak of `worker`'s node (`node_feed`), with a run's result as `breaker_feed`
    says (`kind` None: its media is stored): the breaker's state after (None: nothing to record, or Redis did not
    answer) and the node's streak."""
    if (ok := breaker_feed(kind)) is None:
        return RunRecorded(None)
    settings = ports.settings
    node = holder_node(worker) if node_feed(kind) else None
    try:
        return ports.breaker.breaker_record_run(
            queue, ok, settings.breaker_threshold, settings.breaker_cooldown_seconds, node
        )
    except StoreUnavailable as err:
        log.warning("[GENERATE] breaker of %s not updated: %s", queue, err)
        return RunRecorded(None)


def sick_host(ports: Ports, recorded: RunRecorded) -> dict[str, Any]:
    """What a job's result says of its node's pause (`domain.job_rules.host_pause`): `paused`, the seconds, or none."""
    settings = ports.settings
    seconds = host_pause(
        recorded.streak, threshold=settings.breaker_threshold, cooldown=settings.breaker_cooldown_seconds
    )
    return {} if seconds is None else {"paused": seconds}


def pause_if_sick(ports: Ports, spec: StageSpec, worker: str, later: Later, result: dict[str, Any]) -> dict[str, Any]:
    """A job given back because its node's runs of the queue keep failing (`sick_host`: while other nodes' succeed, or
    its failures opened the queue's breaker): said once, counted (`job:host_paused:<stage>`), then its process takes
    no new job for the pause (`Later.pause`), after which its next job is the node's test. Called once the job is
    over: its lease and slot are free, so the pair it gave back runs elsewhere meanwhile."""
    seconds = result.get("paused")
    if not seconds:
        return result
    log.warning(
        "[GENERATE] host %s: %d or more runs of %s failed in a row (its own backend, unless the stage's breaker is open"
        " too): pairs given back, pausing %gs",
        holder_node(worker),
        ports.settings.breaker_threshold,
        spec.queue,
        seconds,
    )
    quietly("count", ports.counters.add, {f"job:host_paused:{spec.name}": 1})
    later.pause(seconds)
    return result


def pause_while_unanswered(ports: Ports, spec: StageSpec, worker: str, later: Later) -> None:
    """Postgres did not answer a job's start check: its pair goes back with the tick (its lease is released), and
    this process takes no job until Postgres answers it again, a breaker cool-down at most. *Why:* a host cut off
    from Postgres alone, idle while the others ran jobs kept from their refills, took every job published to the
    queue, failed its start a pool timeout later, and took it again once the tick had put it back: a reader's
    interactive scene went round so for minutes while the healthy hosts ran bulk work. A Postgres that answers now (the
    check's wait for its row lock ran out, a read-only primary in a failover) asks for no pause."""
    if ports.jobs.answers():
        return
    seconds = ports.settings.breaker_cooldown_seconds
    log.warning(
        "[GENERATE] host %s: Postgres did not answer a start check of %s: no job taken until it does (%gs at most)",
        holder_node(worker),
        spec.queue,
        seconds,
    )
    quietly("count", ports.counters.add, {f"job:store_paused:{spec.name}": 1})
    later.pause(seconds, until=ports.jobs.answers)
