"""Prompt takeover: on every tick, a `generating` pair whose started job stopped renewing its lease goes
back (`pending` if still authorized, else `dirty`), a job held by a worker node whose heartbeat has stopped
gives up its lease first, and a stage with jobs in flight but no live worker heartbeat is BLOCKED.

Why on the tick and not only in reconcile: a lapsed lease is the one sign that a host died or was cut
off mid-job, and waiting for the 30 s reconcile pass left its pair idle for up to a lease TTL plus that
period (and let it go back to the cut-off host after a heal). Since a queued job holds a queued lease
until it starts (domain/liveness.py), a lapsed lease needs no broker evidence: the tick reads the
`generating` pairs (bounded by the lane limits), their leases and their undelivered markers, three round
trips. A lease-less job that was never delivered (its lease lost with Redis, say) is left to reconcile,
which asks the broker.

Why a silent node's jobs go before their leases lapse: a host that is lost for good, or a pod a deployment
replaced under a new name, never comes back to let go of its jobs (a worker started again under its old name
does, `worker/lost.py`), and its leases held their lane's slots for a whole lease TTL (120 s by default) while
the job could run elsewhere. Its last heartbeat says since when it is gone (`liveness.silent_nodes`). A node only
cut off from Redis that long loses its jobs too: each stops at its next lease renewal once the link is back, and
fencing refuses its commit, as after a lapsed lease (`ANIMASTOR_SILENT_WORKER_SECONDS` is the blip ridden out).

Why a started job's missing lease waits a lease TTL after Redis lost its data (or this process could not reach
it): the running jobs take their leases back at their next renewal (`flow/job.py`), and taking their pairs over
at once stopped every running job of the farm after a Redis restart, their GPU work done again from the start.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from animastor_tasks.domain import liveness
from animastor_tasks.domain.deferral import wait_score
from animastor_tasks.domain.gate import BookFacts, decide
from animastor_tasks.domain.types import Pair
from animastor_tasks.domain.vocabulary import AssetState
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import candidates, lanes, page
from animastor_tasks.ports import GeneratingRow, Ports

log = logging.getLogger("animastor.takeover")
READ_SLACK = 1.0  # seconds between the read of a job's start (Postgres) and of the Redis server's clock


def on_tick(ports: Ports) -> dict[str, int]:
    """The tick's share of reconcile; a store that cannot be read changes nothing this tick."""
    report = {"expired": 0, "blocked": 0, "let_go": 0}
    try:
        generating = ports.assets.generating_pairs()
        if generating:
            block_consumerless(ports, generating, report)
            let_go = let_go_of_silent_nodes(ports, generating, report)
            try:
                expire_lapsed(ports, ports.assets.generating_pairs(), report)
            finally:  # after the takeover (a slow result store delays it not); failed or not: nothing finds them again
                for node, dispatch_ids in let_go.items():
                    why = f"{node} stopped beating running it; its pair taken over"
                    ports.publisher.fail_lost(node, dispatch_ids, why)
    except StoreUnavailable as err:
        log.warning("[TAKEOVER] stores unreadable, %s: %s", _left(report), err)
    except Exception as err:  # the AMQP broker refusing a passive declare: no evidence either way
        log.warning("[TAKEOVER] consumer count unavailable, %s: %s", _left(report), err)
    return report


def _left(report: dict[str, int]) -> str:
    if report["let_go"]:  # their leases are gone: the next tick's takeover finds their pairs lapsed
        return f"the {report['let_go']} job(s) let go of are taken over next tick"
    return "nothing taken over this tick"


def let_go_of_silent_nodes(
    ports: Ports, generating: Sequence[GeneratingRow], report: dict[str, Any]
) -> dict[str, list[str]]:
    """The jobs whose worker node has not beaten for `silent_worker_seconds` give up their leases
    (`abandon_delivery`, as when a node starts again): `expire_lapsed` then takes their pairs over in this same
    tick. Two round trips, both bounded by the jobs in flight; a store error leaves the jobs to their leases. What was
    let go of, by node: their jobs failed for Flower (`Publisher.fail_lost`, Flower showed them STARTED for good)."""
    settings = ports.settings
    try:
        started = [g.dispatch_id for g in generating if g.dispatch_id]
        node_of = {h: liveness.holder_node(h) for h in ports.leases.delivery_holders(started) if h is not None}
        if not node_of:
            return {}
        beats = ports.presence.last_beats(sorted(set(node_of.values())))
        now = ports.clock()  # after the beats' read, which measured this process's offset to the server's clock
        if now - ports.book_state.presence_unsure_since() < settings.silent_worker_seconds:
            return {}  # Redis lost its data or was out of reach moments ago: every node looks silent until it beats
        silent = liveness.silent_nodes(beats, now, settings.silent_worker_seconds)
        lost: Counter[str] = Counter()
        let_go: dict[str, list[str]] = defaultdict(list)
        for holder, node in sorted(node_of.items()):
            freed = ports.leases.abandon_delivery(holder, None) if node in silent else None
            if freed is None:
                continue
            dispatch_id, stage, _ = freed
            lost[f"job:node_lost:{stage}"] += 1
            let_go[node].append(dispatch_id)
            log.warning(
                "[TAKEOVER] worker %s stopped beating %.0fs ago while running dispatch %s: its pair is taken over",
                node,
                now - beats[node],
                dispatch_id,
            )
    except StoreUnavailable as err:
        log.warning("[TAKEOVER] silent workers not looked for this tick: %s", err)
        return {}
    report["let_go"] += sum(lost.values())
    if lost:
        ports.counters.add(lost)
    return let_go


def expire_lapsed(
    ports: Ports, generating: Sequence[GeneratingRow], report: dict[str, Any], *, stopped: bool = False
) -> None:
    """The pairs whose started job stopped renewing its lease go back at once (`stopped`: see `expire`)."""
    holders = ports.leases.lease_holders([(g.book, *g.pair) for g in generating])
    lapsed = without_retakes(ports, [g for g, holder in zip(generating, holders, strict=True) if holder is None])
    if not lapsed:
        return
    marks = ports.leases.undelivered([g.dispatch_id or "" for g in lapsed])
    expire(
        ports, [g for g, mark in zip(lapsed, marks, strict=True) if mark is None or not g.dispatch_id], report, stopped
    )


def take_over_stopped(ports: Ports, book: str, pairs: Sequence[Pair]) -> None:
    """The pairs of jobs that stopped (superseded by a forced regenerate, their book stopped), were fenced off at their
    commit, or were withdrawn while queued, once nothing holds them: taken over now, as the tick would (`expire_lapsed`:
    only while no lease holds a pair, so one claimed anew since, or whose job still runs, is left). *Why:* left
    `generating` for the tick's takeover, their slots stood idle up to a tick (5 s) before the reader's fresh runs went
    out. Not taken here (a store down): the tick takes them over."""
    try:
        if left := [g for g in ports.assets.generating_pairs(book) if g.pair in pairs]:
            expire_lapsed(ports, left, {"expired": 0}, stopped=True)
    except StoreUnavailable as err:
        log.warning("[TAKEOVER] book=%r pairs %s of stopped jobs left to the tick: %s", book, list(pairs), err)


def without_retakes(ports: Ports, lapsed: list[GeneratingRow]) -> list[GeneratingRow]:
    """`lapsed` but the started jobs that may yet take their lease back: those of a stage whose lease TTL has not
    passed since Redis lost its data or answered again (`presence_unsure_since`), or since the Redis server
    started, for a job that started before it. *Why the last:* the control host rebooted with its Redis, its
    processes saw nothing of the restart, and their first tick took every running job over before the jobs'
    next renewals (a third of a lease TTL apart) could take their leases back: their GPU work was done again."""
    started = [g for g in lapsed if g.started]
    if not started:
        return lapsed
    now = ports.clock()
    unsure_since = ports.book_state.presence_unsure_since()
    restarted = ports.book_state.server_started_at()
    registry = ports.settings.registry

    def awaited(g: GeneratingRow) -> bool:
        # Its start by Redis's clock, from its age by Postgres's: a second's slack for the time between the reads.
        before_restart = g.started_ago is not None and now - g.started_ago < restarted + READ_SLACK
        since = max(unsure_since, restarted) if before_restart else unsure_since
        return g.stage in registry and now - since < registry.get(g.stage).lease_ttl

    waiting = {id(g) for g in started if awaited(g)}
    return [g for g in lapsed if id(g) not in waiting]


def expire(ports: Ports, dead: Sequence[GeneratingRow], report: dict[str, Any], stopped: bool = False) -> None:
    """`generating -> pending` where the gate still authorizes the pair, else `-> dirty` (compare-and-set on
    the token, so a pair that moved on meanwhile is left alone). The slots so freed are handed on as a finished
    job's are: the books waiting for a full lane waited for their capacity deferral instead (a minute) while a
    dead worker's slot stood free. A pair sent back to `pending` first puts its book on the lane's waiting list
    at its priority (`_wait_again`), so a more urgent one keeps its slot; a forced re-run's keeps it at any
    priority (its book at the head of its priority). `stopped`: jobs stopped on purpose (`take_over_stopped`), said at
    INFO: a reader's forced regenerate read as a lost worker to an operator looking through the warnings (HA hunt)."""
    pairs_by_book: dict[str, list[Pair]] = defaultdict(list)
    for g in dead:
        pairs_by_book[g.book].append(g.pair)
    facts_by_book: dict[str, BookFacts | None] = {}
    ranks: dict[tuple[str, Pair], int] = {}
    for book, pairs in pairs_by_book.items():
        try:
            read = page.pair_facts(ports, book, pairs)
            facts_by_book[book] = None if read is None else read[0]
            ranks.update(((book, i.pair), i.rank) for i in (read[1].in_flight if read else ()))
        except StoreUnavailable as err:  # fail-closed: not "unauthorized" (that would release the pairs to dirty)
            log.warning("[TAKEOVER] book=%r facts unreadable, its pairs wait for the next tick: %s", book, err)
    reruns = _forced_reruns(ports, dead)
    registry = ports.settings.registry
    freed: Counter[str] = Counter()
    for g in dead:
        if g.book not in facts_by_book:
            continue
        facts = facts_by_book[g.book]
        authorized = facts is not None and decide(facts, g.pair) is None
        asked = AssetState.PENDING if authorized else AssetState.DIRTY
        try:  # `dirty` is judged again under the book's lock: the pair may go `pending` after all
            flagged = page.stop_stands(ports, g.book) if facts is not None and facts.cancel_flag else None
            lapsed = _not_taken_back(ports, g)
            target = ports.assets.expire_generating(g.book, g.pair, g.token, asked, lapsed, stop_stands=flagged)
        except StoreUnavailable as err:  # its lease unreadable: left to the next tick, the slots freed so far handed
            log.warning("[TAKEOVER] book=%r pair %s not taken over this tick: %s", g.book, g.pair, err)
            continue
        if target is not None:
            report["expired"] += 1
            if g.stage in registry:
                freed[registry.get(g.stage).queue] += 1
            if target == AssetState.PENDING:
                _due_now(ports, g.book)
                if (g.book, g.pair) in ranks and g.stage in registry:
                    since = 0.0 if g.dispatch_id in reruns else ports.clock()
                    rank = _pending_rank(ports, g.book, g.stage, ranks[(g.book, g.pair)])
                    _wait_again(ports, g.book, registry.get(g.stage).queue, rank, since)
            log.log(
                logging.INFO if stopped else logging.WARNING,
                "[TAKEOVER] book=%r chapter=%r scene=%r stage=%s token=%d %s: generating -> %s",
                g.book,
                g.chapter,
                g.scene,
                g.stage,
                g.token,
                "job stopped" if stopped else "lease gone",
                target,
            )
    for queue, slots in freed.items():
        try:
            lanes.hand_over(ports, queue, slots)
        except StoreUnavailable as err:  # the waiting books' deferrals still bring them back
            log.warning("[TAKEOVER] %d freed slot(s) of %s not handed on: %s", slots, queue, err)


def _not_taken_back(ports: Ports, g: GeneratingRow) -> Callable[[], bool]:
    """Whether the pair's job has still not taken its lease back (`flow/job.Watcher`), asked by the expiry under the
    pair's row lock. *Why:* read once before, a job that came back in between took its lease back and ran on, its
    pair handed on under it (its lane over-full, its work thrown away at its commit)."""
    return lambda: g.dispatch_id is None or ports.leases.lease_holders([(g.book, *g.pair)]) != [g.dispatch_id]


def _forced_reruns(ports: Ports, dead: Sequence[GeneratingRow]) -> set[str]:
    """The dispatch ids of `dead` that a forced regenerate fenced off (`Leases.superseded`); none if unreadable."""
    ids = [g.dispatch_id for g in dead if g.dispatch_id]
    try:
        return {d for d, hit in zip(ids, ports.leases.superseded(ids), strict=True) if hit}
    except StoreUnavailable as err:
        log.warning("[TAKEOVER] forced re-runs not told from other takeovers: %s", err)
        return set()


def _pending_rank(ports: Ports, book: str, stage: str, rank: int) -> int:
    """The more urgent of `rank` (a pair sent back to `pending`) and the book's most urgent pending pair's of the stage
    (each active command's first pending target), as a job's end weighs its book (`Jobs.commit_job`). *Why:* weighed
    at its dead bulk job's rank, a capped book whose reader's scene its cap had refused (on no list) waited behind the
    normal books for the room that job freed. Unreadable: `rank`."""
    try:
        found = candidates.most_urgent_rank(ports, book, [stage])
    except StoreUnavailable as err:
        log.warning("[TAKEOVER] book=%r pending pairs unreadable, it waits at its pair's priority: %s", book, err)
        return rank
    return rank if found is None else min(rank, found)


def _wait_again(ports: Ports, book: str, queue: str, rank: int, since: float) -> None:
    """The book of a pair sent back to `pending` waits for the lane at `rank` (`_pending_rank`; a place it holds
    already stands if earlier) before the freed slot is handed on, so the slot goes to it when it outranks the head of
    the list, and behind the books that waited longer at its own priority (as at a job's end, `lua/lane_take.lua`).
    *Why:* handed to the head of a list the book was not on, a reader's interactive scene waited a whole job
    behind normal or bulk work. `since` 0: a forced re-run keeps the slot its fenced-off job held (design §7.1), at
    the head of its priority: the reader who asked to redo a scene waited behind every book waiting for the lane.
    Lost with Redis, the book waits its turn (its due pass puts it on the list)."""
    try:
        ports.deferrals.wait_for_lane(queue, book, wait_score(rank, since))
    except StoreUnavailable as err:
        log.warning("[TAKEOVER] book=%r not put back on the waiting list of %s: %s", book, queue, err)


def _due_now(ports: Ports, book: str) -> None:
    """The book's next gate pass is due now (the tick that took the pair over sends it), so the pair is
    dispatched again at once, to whichever live host takes it first."""
    try:
        ports.book_state.set_due(book, ports.clock())
    except StoreUnavailable as err:
        log.warning("[TAKEOVER] book=%r not marked due; its next pass dispatches the pair: %s", book, err)


def block_consumerless(ports: Ports, generating: Sequence[GeneratingRow], report: dict[str, Any]) -> None:
    """Jobs in flight on a queue with no live consumer (heartbeats decide; the broker's count may only lower
    them): BLOCK their commands, neutralise the jobs."""
    by_stage: dict[str, set[str]] = defaultdict(set)
    for g in generating:
        by_stage[g.stage].add(g.book)
    specs = [ports.settings.registry.get(s) for s in by_stage if s in ports.settings.registry]
    if not specs:
        return
    if ports.clock() - ports.book_state.presence_unsure_since() < ports.settings.presence_ttl_seconds:
        return  # Redis lost its data or came back moments ago: presence not rebuilt yet, "no consumer" proves nothing
    try:
        counts = ports.presence.counts([s.queue for s in specs])
        unconsumed = [s for s in specs if counts.get(s.queue, 0) == 0]
        gone = lanes.gone_for_good(ports, [s.queue for s in unconsumed])
    except StoreUnavailable as err:  # a broker that cannot count says nothing of the workers: the pass goes on
        log.warning("[TAKEOVER] consumers unreadable, blocking nothing this pass: %s", err)
        return
    for spec in unconsumed:
        if spec.queue in gone:
            report["blocked"] += len(lanes.block_lane(ports, spec, sorted(by_stage[spec.name])))
            # Their passes (due now: this tick's) take the books whose pairs all went off the active index. *Why:*
            # nothing else passed them, no work left for reconcile to visit, and they stayed active for good.
            try:
                ports.book_state.set_due_all(sorted(by_stage[spec.name]), ports.clock())
            except StoreUnavailable as err:  # reconcile's rebuild and its next pass over the books do it later
                log.warning("[TAKEOVER] blocked books of %s not made due: %s", spec.queue, err)
