"""Regenerate: the only way work begins.

One command per enabled stage for the named scenes (or the whole book); the targets move
to `pending`, the Redis side (force set, deferrals cleared, active index) follows, and a
gate pass starts at once so the first job never waits for the next tick.

A target whose job is running is not taken from it (`domain.targets.regenerate_take`): without
force that job's commit serves the new command (unless the job started from other inputs than the
scene's now: re-imported while it ran); with force (or so) the job is fenced off in Postgres and
told to stop through its lease, its pair stays `generating` (its slot counts) until it has
stopped, and reconcile then hands the pair back to `pending` for a fresh run.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, cast

from animastor_tasks.domain.book import show_value
from animastor_tasks.domain.gate import layer_enabled, parse_layers
from animastor_tasks.domain.resend import resend_differs
from animastor_tasks.domain.types import Pair, SceneKey
from animastor_tasks.domain.vocabulary import CommandStatus, Priority
from animastor_tasks.errors import BookBusy, DuplicateCommand, InvalidCommand, StoreUnavailable
from animastor_tasks.flow import gate, page, pass_hold, refill, takeover, validate
from animastor_tasks.flow.pass_hold import PassHold
from animastor_tasks.ports import CommandContext, CommandRow, LiftedFlag, Ports, Snapshot

log = logging.getLogger("animastor.commands")
BIG_BOOK_SCENES = 500  # active scenes (the active index) from which a regenerate does not pass the whole book


def _describe(rows: list[CommandRow]) -> list[dict[str, Any]]:
    return [{"command_id": r.command_id, "stage": r.stage, "targets": r.targets, "status": r.status} for r in rows]


def regenerate(
    ports: Ports,
    book_id: object,
    stages: object,
    scenes: object = None,
    command_id: object = None,
    force: object = True,
    priority: object = None,
    sent_at: float | None = None,
) -> dict[str, Any]:
    """Create one command per stage for the named scenes and start a gate pass at once. `sent_at`: when its sender sent
    it (the client's stamp); sent before a Stop All of the book that was taken first, it is void.

    A scene whose job is running: with `force=False` the running job completes it for this command;
    with `force=True` that job is stopped (its output, if it still commits, is refused) and a fresh run
    is dispatched once it has stopped (within one tick of its return).
    """
    if not isinstance(force, bool):
        raise InvalidCommand(f"force: must be true or false, got {show_value(force)}")
    request_id = validate.request_id(command_id)
    rank = validate.priority(priority)
    book = validate.book_id(book_id)
    wanted = validate.stage_names(ports, stages)
    named = validate.scene_ids(scenes)
    # Every check that needs the store, in one transaction.
    context = ports.catalog.command_context(book, named, request_id)
    if not context.exists:
        raise InvalidCommand(f"book_id: unknown book {show_value(book)}")
    if context.replay_of:
        return _replay(ports, context, request_id, book, wanted, force, rank, named)
    if named is not None:
        found = set(context.scenes)  # *why a set:* 40,000 scenes named held the control process 37 s
        missing = [i for i, pair in enumerate(named) if pair not in found]
        if missing:
            i = missing[0]
            raise InvalidCommand(f"scenes[{i}]: scene {show_value(list(named[i]))} is not in book {show_value(book)}")
    targets = named if named is not None else context.scenes

    layers = parse_layers(context.layers_raw)
    skipped = [{"stage": s, "reason": "layer_disabled"} for s in wanted if not layer_enabled(layers, s)]
    enabled = [s for s in wanted if layer_enabled(layers, s)]
    if not enabled:
        return {"commands": [], "skipped": skipped}
    if ports.book_state.void_if_stopped(book, request_id, validate.sent_at(sent_at, ports.clock())):
        # A Stop All sent after it overtook it in the control queue (its priority): taken in the order they were sent,
        # the Stop All would have cancelled it. (One the other control process takes while this one writes its
        # commands is as before: whichever writes last stands.)
        log.info("[COMMAND] book=%r regenerate request=%s sent before a Stop All taken first: void", book, request_id)
        return {"commands": [], "skipped": [*skipped, *({"stage": s, "reason": "stopped"} for s in enabled)]}

    per_stage = {
        stage: (request_id if len(enabled) == 1 else str(uuid.uuid5(uuid.UUID(request_id), stage)), targets)
        for stage in enabled
    }
    # A new explicit intent lifts the cancel; Redis first, so a Redis outage writes nothing.
    lifted = ports.book_state.lift_cancel_flag(book, request_id, ports.clock())
    try:
        # As named (`all` kept): `validate.stage_names` above checked it is a list or tuple of known names.
        asked = (list(dict.fromkeys(cast("list[str]", stages))), named is None)
        created = ports.commands.create_commands(book, request_id, per_stage, force, rank, asked)
    except BaseException as err:
        _keep_cancelled(ports, book, request_id, lifted)
        if not isinstance(err, DuplicateCommand):
            raise
        again = ports.catalog.command_context(book, named, request_id)  # a resend that came in meanwhile made them
        if not again.replay_of:  # the id of a command that another request of several stages made
            raise InvalidCommand(
                f"command_id: {request_id} is already the id of a command of another request; send a new id"
            ) from None
        return _replay(ports, again, request_id, book, wanted, force, rank, named)
    if created.targets is not None:  # the book's scenes as its commands were written (an import may come between)
        targets = created.targets
    snap, pairs, hold = _start_work(ports, book, enabled, targets, force, request_id)
    with _first_pass(ports, book, hold):
        if created.superseded:
            _stop_superseded(ports, book, created.superseded)
        log.info(
            "[COMMAND] book=%r regenerate stages=%s scenes=%d request=%s skipped=%s",
            book,
            ",".join(enabled),
            len(targets),
            request_id,
            ",".join(s["stage"] for s in skipped) or "none",
        )
        _first_dispatch(ports, book, snap, pairs)
    # The statuses alone (the pass may have settled a command): a command's progress joins every one of its targets.
    statuses = ports.commands.command_statuses([cid for cid, _ in per_stage.values()])
    lost = sorted(cid for cid, _ in per_stage.values() if cid not in statuses)
    if lost:  # unflushed as Postgres crashed: a KeyError was a bug, and a client resending on this lost them
        detail = f"commands {', '.join(lost)} were lost after their write: send the request again"
        raise StoreUnavailable("postgres", ports.settings.database_url, detail)
    described = [
        {"command_id": cid, "stage": stage, "targets": [list(t) for t in targets], "status": statuses[cid]}
        for stage, (cid, _) in sorted(per_stage.items())
    ]
    return {"commands": described, "skipped": skipped}


def _keep_cancelled(ports: Ports, book: str, request_id: str, lifted: LiftedFlag) -> None:
    """This request having made no command, its lift ends and the cancel flag it lifted is put back: a Stop All's own
    always, one mirroring the book's tombstone while that stands (read again after, as reconcile does: a regenerate
    that lifted it meanwhile keeps it lifted). *Why:* a running job stops on the flag, which may be all that stops it
    (its Stop All could not reach it otherwise): lifted by a regenerate that was then refused, the job ran on to its
    end."""
    try:
        if lifted == "stop":
            ports.book_state.end_lift(book, request_id, put_back="stop")
            return
        mirror = lifted == "mirror" and ports.commands.is_tombstoned(book)
        ports.book_state.end_lift(book, request_id, put_back="mirror" if mirror else None)
        if mirror and not ports.commands.is_tombstoned(book):
            ports.book_state.clear_mirror_flag(book)
    except StoreUnavailable as err:  # reconcile sets it again from the tombstone
        log.warning("[COMMAND] book=%r cancel flag not set again after a refused regenerate: %s", book, err)


def _start_work(
    ports: Ports, book: str, stages: list[str], targets: list[SceneKey], force: bool, request_id: str
) -> tuple[Snapshot | None, list[Pair], PassHold]:
    """The commands' Redis side (`BookState.start_work`); returns the snapshot the first gate pass needs, read
    after those writes in the same round trip, the pairs, and the first pass's hold written with them
    (flow/pass_hold.py: the tick passes the book should this process die before its pass ends)."""
    pairs = [(c, s, stage) for stage in stages for c, s in targets]
    now, holder = ports.clock(), uuid.uuid4().hex
    snap = ports.book_state.start_work(
        book,
        pairs,
        targets,
        force_ttl=ports.settings.force_ttl_seconds if force else None,
        snapshot=(now, ports.settings.registry.queues()),
        most_scenes=BIG_BOOK_SCENES,
        lifted=request_id,
        hold=(holder, now + pass_hold.HOLD_SECONDS),
    )
    return snap, pairs, PassHold(ports, [book], holder=holder, written=True)


@contextmanager
def _first_pass(ports: Ports, book: str, hold: PassHold) -> Iterator[None]:
    """The first pass under its hold, let go as it ends. One that raised leaves the book due for the tick's next
    pass: its commands are written. *Why:* left held, the book waited 20 s and was counted as a lost pass. One that
    found its book busy is the tick's to do, and the request is answered."""
    with hold:
        try:
            yield
        except BookBusy as err:  # not an outage: told one, its caller resent a command that stood already
            log.info("[COMMAND] book=%r first pass left to the tick's: %s", book, err)
            _due_now(ports, book, None)
            return
        except Exception:
            _due_now(ports, book, None)
            raise
        hold.ended(book)  # a pass of it ended: its lost passes, if any, are forgotten


def _first_dispatch(ports: Ports, book: str, snap: Snapshot | None, pairs: list[Pair]) -> None:
    """The pass that starts the command's work at once. In a big book (no snapshot: `start_work` read none) it
    is the refill's read of the book's next pairs in slot order (an interactive scene is the first of them),
    not a pass over every pair in flight: a reader's one scene in a book of 50,000 pending pairs cost half a
    second of the control worker, 35 ms of it reading the book's sets from Redis. A target the refill did not
    judge (behind the book's backlog) is left to the full pass, which writes why it waits: the book is due
    for it at once."""
    if snap is not None:
        if gate.gate_pass(ports, book, snapshot=snap).error:
            # It read nothing (a store did not answer): the tick's next pass does its work. Left as it was, the book
            # reached the due index through no one, the new work waiting for reconcile's round to come to it.
            _due_now(ports, book, snap.due_at)
        return
    report = refill.refill(ports, book)
    judged = report.denied.keys() | set(report.authorized)
    if report.error or not judged.issuperset(pairs):
        _due_now(ports, book, None)


def _due_now(ports: Ports, book: str, due_at: float | None) -> None:
    """The book due for the tick's next pass. Redis refusing this too (it refused the pass): the command is written
    all the same, and reconcile's round comes to the book."""
    try:
        page.write_due(ports, book, ports.clock(), due_at)
    except StoreUnavailable as err:
        log.warning("[COMMAND] book=%r due index not written; reconcile's round finds the work: %s", book, err)


def _stop_superseded(ports: Ports, book: str, superseded: list[tuple[Pair, str | None]]) -> None:
    """Jobs a regenerate fenced off (forced, or running on inputs re-imported since: their token moved on in Postgres
    already). A running one's lease, still
    held by it, is swapped for a stop marker, so the job's next renewal fails and it stops, while the pair reads as
    held (reconcile leaves it `generating`, its slot counted) until the job has returned or one lease TTL after its
    worker died. A job still queued (no delivery runs it) has nothing to return from: its lease is withdrawn, and
    the next tick gives the pair's slot to the fresh run (a marker held it a lease TTL); its message is revoked,
    and refused at its start if it comes all the same. Each is judged and acted on in one atomic step
    (`Leases.supersede`): a job that ends meanwhile is never left a marker. A job whose delivery began after
    that fails its start check: its token moved on first. Should Redis fail here a running job runs on, fenced
    off, and its pair comes back when its lease ends."""
    registry = ports.settings.registry
    held = [((book, *pair), d, registry.get(pair[2]).lease_ttl) for pair, d in superseded if d and pair[2] in registry]
    # Remembered as long as a job may run (below the visibility timeout), for the takeover of its pair (§7.1).
    running = ports.leases.supersede(held, ports.settings.visibility_timeout)
    dispatch_ids = [d for _, d in superseded if d]
    if dispatch_ids:
        ports.publisher.revoke(dispatch_ids)
    takeover.take_over_stopped(ports, book, [pair for pair, _ in superseded])  # those withdrawn: for this pass
    log.info("[COMMAND] book=%r fenced off %d job(s), %d running: told to stop", book,
             len(superseded), running)  # fmt: skip


def _replay(
    ports: Ports,
    context: CommandContext,
    request_id: str,
    book: str,
    wanted: list[str],
    force: bool,
    rank: Priority,
    named: list[SceneKey] | None,
) -> dict[str, Any]:
    """The commands a resend of `request_id` made, held to the request they were first made from (domain/resend.py).

    Those still active have their Redis side written again and a gate pass: a first sending whose Redis writes
    failed after its commands committed (the caller heard `StoreUnavailable` and resent, as it should) left
    their pairs behind old deferrals, forced pairs settled as already completed, and nothing dispatched."""
    first = context.first_sending
    changed = "book_id" if first is None else resend_differs(first, book, wanted, force, rank, named is None)
    if changed == "book_id":
        raise InvalidCommand(f"command_id: {request_id} was already used for another book")
    if changed is not None:
        raise InvalidCommand(
            f"command_id: {request_id} was first sent with other {changed}; a resend must repeat its request"
            " (send a new command_id for a new one)"
        )
    rows = ports.commands.commands(command_ids=context.replay_of)
    active = sorted({r.stage for r in rows if r.status == CommandStatus.ACTIVE})
    if active:
        targets = named if named is not None else context.scenes
        snap, pairs, hold = _start_work(ports, book, active, targets, force, request_id)
        with _first_pass(ports, book, hold):
            _first_dispatch(ports, book, snap, pairs)
    # The stages it asked for that made no command had their layer off, as the first answer said (known only of
    # a command that keeps what its request asked: migration 0009).
    skipped = [] if first is None or first.asked_stages is None else [s for s in wanted if s not in first.stages]
    # Read after the pass, as a first answer's are, and once they are on disk: a resend that came before the first
    # sending's commands were flushed (they commit without waiting) answered for commands a crash could lose.
    statuses = ports.commands.command_statuses([r.command_id for r in rows])
    return {
        "commands": _describe([replace(r, status=statuses.get(r.command_id, r.status)) for r in rows]),
        "skipped": [{"stage": s, "reason": "layer_disabled"} for s in skipped],
        "replayed": True,
    }
