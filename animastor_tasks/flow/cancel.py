"""Stop All: after `cancel` returns, no job of the book may start GPU work until a new regenerate.

The Redis flag goes first (running jobs see it within their watcher's poll and the gate
denies at once), then the Postgres tombstone, the commands and the in-flight pairs.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from animastor_tasks.domain.types import Pair
from animastor_tasks.errors import InvalidCommand, StoreUnavailable
from animastor_tasks.flow import lanes, validate
from animastor_tasks.ports import Ports

log = logging.getLogger("animastor.commands")


def cancel(ports: Ports, book_id: object, reason: object = None, sent_at: float | None = None) -> dict[str, Any]:
    """Stop All: after this returns no job of the book may start GPU work until a new regenerate. `sent_at`: when its
    sender sent it (the client's stamp, by the broker's clock): a regenerate sent before it and taken after it is void
    (`regenerate`). A Stop All with none counts as sent when it is taken. *Why:* sent by hand or from Flower, at the
    control queue's first priority, it overtook the client's normal and bulk regenerates sent before it, which then
    ran; now those sent while it waited in the queue are void too."""
    why = validate.reason(reason)
    try:
        book = validate.known_book(ports, book_id)
    except StoreUnavailable:
        # Postgres does not answer: whether the book exists is unknown, and the flag goes all the same (the caller
        # is told to send the Stop All again). *Why:* nothing was written, and the running jobs, which only the flag
        # stops, ran on to their end and committed once Postgres was back.
        ports.book_state.stop_book(validate.book_id(book_id), ports.settings.registry.queues(), _stamp(ports, sent_at))
        raise
    except InvalidCommand:
        _unflag_unknown(ports, book_id)
        raise
    # The flag goes first: from this moment running jobs see should_stop() and the gate denies.
    ports.book_state.stop_book(book, ports.settings.registry.queues(), _stamp(ports, sent_at))
    cancelled, released, dispatched = ports.commands.cancel_book(book, why)
    try:
        let_go(ports, book, dispatched)
    except StoreUnavailable as err:
        # Committed, the Stop All holds: the flag stops the jobs (each drops its lease as it ends, a queued one is
        # refused at its start), and the slots left unhanded go to the waiting books once their deferrals end.
        log.warning("[COMMAND] book=%r cancelled; its leases or freed slots not handed on: %s", book, err)
    log.info(
        "[COMMAND] book=%r cancelled commands=%d released=%d revoked=%d reason=%r",
        book,
        len(cancelled),
        released,
        len(dispatched),
        why,
    )
    return {"book_id": book, "cancelled_commands": cancelled, "released": released, "revoked": len(dispatched)}


def _stamp(ports: Ports, sent_at: float | None) -> float:
    now = ports.clock()
    believed = validate.sent_at(sent_at, now)
    return now if believed is None else believed


def _unflag_unknown(ports: Ports, book_id: object) -> None:
    """A book Postgres does not hold: a flag a Stop All of it left while Postgres did not answer (above) stops nothing,
    and goes. *Why:* the resend that caller was told to send was refused as of an unknown book, and the flag stayed
    for good: a book imported later under that id read as cancelled."""
    try:
        ports.book_state.clear_stop_flag(validate.book_id(book_id))
    except InvalidCommand:  # not a book id at all: no flag was set for it
        pass
    except StoreUnavailable as err:
        log.warning("[COMMAND] book=%r unknown; a cancel flag of it, if any, not lifted: %s", book_id, err)


def let_go(ports: Ports, book: str, dispatched: Sequence[tuple[Pair, str]], *, book_goes_on: bool = False) -> None:
    """The released jobs' leases dropped (each only while its dispatch holds it: a claim made since the commit
    keeps its own) and revoked (a running job stops at its next renewal, or at once on a cancel flag; a queued
    one is refused at its start), their slots handed to the books waiting for them. `book_goes_on` (its scenes were
    removed, the book not stopped): the book may be served too, and takes the slots nobody waits for. *Why:* handed
    to the others alone, they idled until the tick's pass of the book (2.5 to 7 s in a hunt) while its pairs waited."""
    ports.leases.release_leases([((book, *pair), dispatch_id) for pair, dispatch_id in dispatched])
    if dispatched:
        ports.publisher.revoke([d for _, d in dispatched])
    registry = ports.settings.registry
    for stage, slots in Counter(stage for (_, _, stage), _ in dispatched).items():
        if stage not in registry:
            continue
        queue = registry.get(stage).queue
        served = lanes.hand_over(ports, queue, slots, exclude=None if book_goes_on else book)
        if book_goes_on and not served:
            ports.publisher.enqueue_refill(book, queue, slots=slots)
