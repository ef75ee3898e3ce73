"""Reconcile: the beat's repair pass (every 30 s).

It repairs, it never creates work: a `generating` pair with no live lease goes
back to `pending` if it is still authorized (else `dirty`), a stage whose queue lost
every consumer is BLOCKED, `pending` without authority is released, and after a Redis
loss the active index and cancel flags are rebuilt from Postgres. The
tick does the lease and consumer part every few seconds (flow/takeover.py); what only
reconcile does there is ask the broker which never-started jobs still wait in their queue.

The per-book part (the active index, the dispatch-free pass) takes the books with work in
turns: each pass the next ones up to `ANIMASTOR_RECONCILE_PAIRS` pairs in flight (domain/rounds.py)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from animastor_tasks.domain import liveness, rounds
from animastor_tasks.domain.types import Pair
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import cancel, gate, lanes, takeover
from animastor_tasks.flow.rebuild import BOOKMARK, REBUILDING, rebuild
from animastor_tasks.ports import GeneratingRow, Ports

log = logging.getLogger("animastor.reconcile")
RECOUNT_PAUSE_SECONDS = 0.5
PRUNED_TARGETS_PER_PASS = 50_000  # command targets one pass deletes at most (a whole-book command's: all of them)
ARTIFACT_ROWS_PER_PASS = 20_000  # artifact rows one pass looks at, from where the last one stopped
ARTIFACTS_BOOKMARK = "artifacts"  # the artifact row the pruning goes on after


def reconcile(ports: Ports, *, force: bool = False, whole: bool = False) -> dict[str, Any]:
    """One repair pass over the next books with work (domain/rounds.py), or over every one with `whole`."""
    lock_seconds = ports.settings.reconcile_seconds * liveness.PERIODIC_LOCK_SHARE
    if not force and not ports.locks.try_lock("reconcile", lock_seconds):
        return {"skipped": True}
    started = time.monotonic()
    report: dict[str, Any] = {
        "rebuilt_books": 0,
        "expired": 0,
        "blocked": 0,
        "released": 0,
        "orphans": 0,
        "pruned_events": 0,
        "pruned_commands": 0,
        "pruned_artifacts": 0,
    }
    work = ports.commands.books_with_work()
    # No bookmark: Redis lost its data (or this is the first pass), so every book's active index is rebuilt now.
    bookmark = None if whole else ports.locks.bookmark(BOOKMARK)
    if bookmark == REBUILDING:  # the pass that rebuilt every book did not end
        bookmark = None
    if bookmark is None and not whole:  # what the bookmark written at its end goes over (below)
        ports.locks.set_bookmark(BOOKMARK, REBUILDING)
    books, following = (
        (sorted(work), "") if whole else rounds.next_books(work, bookmark or "", ports.settings.reconcile_pairs)
    )
    rebuild(ports, list(work) if bookmark is None else books, report)
    _expire_dead_generating(ports, report)
    _let_go_of_orphans(ports, report)
    _block_consumerless(ports, report)
    # The books' facts read several at a time, as the tick's passes read them: one statement per book cost
    # most of a reconcile (9 ms of 10 per book of 1,000 pairs).
    report["released"] += sum(len(r.released) for r in gate.gate_batch(ports, books, dispatch_work=False))
    # A slot whose refill was lost (its process died after the commit, Redis failed under the refill and its
    # fallback) stood free while its books waited on capacity deferrals that each later refill of the lane wrote
    # again: every lane's free slots go to the books waiting for it (one statement). The tick hands on only those it
    # finds on two ticks running (`lanes.hand_on_stranded`): one sighting races with the refills on their way.
    lanes.hand_on_freed(ports, set(ports.settings.registry.queues()))
    ports.deferrals.prune_deferrals(books, ports.clock())
    report["pruned_events"] = ports.journal.prune_journal(
        ports.settings.journal_retention_days, ports.settings.journal_max_rows
    )
    if ports.settings.command_retention_days > 0:
        report["pruned_commands"] = ports.commands.prune_commands(
            ports.settings.command_retention_days, PRUNED_TARGETS_PER_PASS
        )
    report["pruned_artifacts"] = _prune_artifacts(ports)
    # Over the bookmark read (or REBUILDING), if it is still there: Redis losing its data during the pass took it, and
    # written again, the next pass rebuilt only its own slice while the other books' indexes and due entries were
    # gone (they waited for the round to come to them, minutes at scale, their slots idle). Without it, the next pass
    # rebuilds them all.
    ports.locks.set_bookmark(BOOKMARK, following, kept=not whole)
    report.update(passed_books=len(books), books_with_work=len(work), round_done=not following)
    if not whole:  # the beat's passes: a whole-farm one (`animastor-tasks reconcile`) would skew their percentiles
        ports.counters.observe("reconcile_seconds", time.monotonic() - started)
    if any(report[k] for k in ("expired", "blocked", "released", "orphans")):
        log.info("[RECONCILE] %s", report)
    return report


def _prune_artifacts(ports: Ports) -> int:
    """Artifact rows no pair points to any more, kept as long as the journal (0: no age limit, kept for ever)."""
    settings = ports.settings
    if settings.journal_retention_days <= 0:
        return 0
    # At least a visibility timeout: a commit sent again (its answer lost) is told it landed by its dispatch's row.
    days = max(settings.journal_retention_days, settings.visibility_timeout / 86400)
    after = int(ports.locks.bookmark(ARTIFACTS_BOOKMARK) or 0)  # lost with Redis's data: a round starts over
    pruned, after = ports.journal.prune_artifacts(days, after, ARTIFACT_ROWS_PER_PASS)
    ports.locks.set_bookmark(ARTIFACTS_BOOKMARK, str(after))
    return pruned


def _expire_dead_generating(ports: Ports, report: dict[str, Any]) -> None:
    generating = ports.assets.generating_pairs()
    if not generating:
        return
    holders = ports.leases.lease_holders([(g.book, *g.pair) for g in generating])
    registry = ports.settings.registry
    # A job still waiting in its queue holds a queued lease until it starts (domain/liveness.py); the broker
    # says which undelivered jobs still wait. One it no longer holds was lost: its lease goes, so it expires.
    evidence = _queue_evidence(ports, generating)
    if evidence is None:
        return  # the broker cannot be read: no evidence either way, the next pass decides
    queued, lost = evidence
    waiting = [g for g in generating if g.dispatch_id is not None and g.dispatch_id in queued and g.stage in registry]
    superseded = ports.leases.restore_leases(
        [((g.book, *g.pair), g.dispatch_id or "", g.token, liveness.queued_lease_ttl()) for g in waiting]
    )
    _drop_restored_of_released(ports, [g for g in waiting if g.dispatch_id not in superseded])
    lost = lost | superseded
    for g, holder in zip(generating, holders, strict=True):
        if g.dispatch_id in lost and holder == g.dispatch_id:
            ports.leases.release_lease((g.book, *g.pair), g.dispatch_id)
            log.warning(
                "[RECONCILE] book=%r chapter=%r scene=%r stage=%s dispatch=%s never started and no longer in"
                " its queue: lease dropped",
                g.book,
                g.chapter,
                g.scene,
                g.stage,
                g.dispatch_id,
            )
    lapsed = [
        g for g, holder in zip(generating, holders, strict=True) if holder is None and g.dispatch_id not in queued
    ]
    dead = [g for g in generating if g.dispatch_id in lost] + [
        g for g in takeover.without_retakes(ports, lapsed) if g.dispatch_id not in lost
    ]
    takeover.expire(ports, dead, report)


def _let_go_of_orphans(ports: Ports, report: dict[str, Any]) -> None:
    """The running jobs whose pair Postgres gives them no more (no row: a re-import removed its scene; or a row that
    carries another dispatch) are let go as the CLI lets go of a removed scene's (`cancel.let_go`): each stops at its
    next lease renewal. *Why:* the CLI does so once, after the import's commit; killed in between, or Redis failing
    that call, the job ran on to its time limit and its output was refused at its commit, its lane meanwhile counting
    the slot free. Redis is read first, Postgres after: a job holds a running lease only once its message is out,
    after its claim's commit, so a job just dispatched is never read as gone. A row with no dispatch (released, given
    back, taken over) is not judged: a job ending holds its lease a moment after writing it, and the cancel flag or a
    lapsed lease stops the others. Bounded by the worker processes on record, whatever the books hold."""
    try:
        running = ports.leases.held_jobs(ports.presence.nodes())
        rows = ports.assets.dispatch_ids([pair for pair, _ in running])
        orphans: dict[str, list[tuple[Pair, str]]] = defaultdict(list)
        for (book, chapter, scene, stage), dispatch_id in running:
            carried = rows.get((book, chapter, scene, stage), "")  # "": no row
            if carried not in (None, dispatch_id):
                orphans[book].append(((chapter, scene, stage), dispatch_id))
        for book, jobs in orphans.items():
            log.warning("[RECONCILE] book=%r jobs of pairs no longer theirs let go: %s", book, jobs)
            cancel.let_go(ports, book, jobs, book_goes_on=True)
            report["orphans"] += len(jobs)
    except StoreUnavailable as err:  # the next pass looks again
        log.warning("[RECONCILE] running jobs of pairs gone not looked for this pass: %s", err)


def _drop_restored_of_released(ports: Ports, restored: Sequence[GeneratingRow]) -> None:
    """A pair released since it was read (Stop All, BLOCKED: `dirty`, its lease dropped), or whose job a forced
    regenerate fenced off (its token moved on, its lease withdrawn), got its lease back from the restore: it is
    dropped again (compare-and-delete). Left, that `dirty` pair held it for a queued lease's day, every regenerate
    without force deferred as `already_generating`, or the forced run never went out. Both write Postgres before
    they touch the lease, so a change this read misses drops the restored lease itself."""
    if not restored:
        return
    still = {(g.book, g.pair, g.dispatch_id, g.token) for g in ports.assets.generating_pairs()}
    for g in restored:
        if (g.book, g.pair, g.dispatch_id, g.token) not in still:
            ports.leases.release_lease((g.book, *g.pair), g.dispatch_id or "")


def _queue_evidence(ports: Ports, generating: Sequence[GeneratingRow]) -> tuple[set[str], set[str]] | None:
    """(dispatch ids still waiting in their queue, never-delivered ones the broker no longer holds) among the
    `generating` pairs (domain/liveness.py); None when the broker cannot be read."""
    registry = ports.settings.registry
    rows = [g for g in generating if g.dispatch_id and g.stage in registry]
    if not rows:
        return set(), set()
    queues = {registry.get(g.stage).queue for g in rows}

    def look() -> tuple[set[str], set[str]]:
        """(waiting in their queue, never delivered and not waiting)."""
        listed = ports.queue_probe.queued_dispatch_ids(registry.queues())
        # The counts first, the markers after: a job taken in between is still counted, never missed.
        depths = None if listed is not None else ports.queue_probe.queue_depths(queues)
        marks = ports.leases.undelivered([g.dispatch_id or "" for g in rows])
        dispatches = [
            liveness.Dispatched(g.dispatch_id or "", registry.get(g.stage).queue, m)
            for g, m in zip(rows, marks, strict=True)
        ]
        queued = liveness.still_queued(dispatches, listed, depths)
        if listed is None and depths is None:
            return queued, set()  # a broker that can neither list nor count: nothing is proven lost
        undelivered = {d.dispatch_id for d in dispatches if d.dispatched_at is not None}
        return queued, liveness.lost_in_queue(undelivered, queued)

    try:
        queued, lost = look()
        if lost:
            # A job a worker took a moment ago is neither ready in its queue nor marked delivered yet:
            # look once more before taking a counted job for lost.
            time.sleep(RECOUNT_PAUSE_SECONDS)
            again, still_lost = look()
            queued |= again
            lost = (lost & still_lost) - queued
    except StoreUnavailable as err:
        log.warning("[RECONCILE] broker unreadable, no lease-less job expired this pass: %s", err)
        return None
    return queued, lost


def _block_consumerless(ports: Ports, report: dict[str, Any]) -> None:
    """Jobs queued on a queue that lost every consumer: BLOCK their commands, neutralise the jobs."""
    takeover.block_consumerless(ports, ports.assets.generating_pairs(), report)
