"""Stop All: after `cancel` returns, no job of the book may start GPU work until a new regenerate.

The Redis flag goes first (running jobs see it within their watcher's poll and the gate
denies at once), then the Postgres tombstone, the commands and the in-flight pairs.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from animastor_tasks.flow import dispatch, validate
from animastor_tasks.ports import Ports

log = logging.getLogger("animastor.commands")


def cancel(ports: Ports, book_id: object, reason: object = None) -> dict[str, Any]:
    """Stop All: after this returns no job of the book may start GPU work until a new regenerate."""
    why = validate.reason(reason)
    book = validate.known_book(ports, book_id)
    # The flag goes first: from this moment running jobs see should_stop() and the gate denies.
    ports.book_state.stop_book(book)
    cancelled, released, dispatched = ports.commands.cancel_book(book, why)
    ports.leases.drop_leases([(book, *pair) for pair, _ in dispatched])
    dispatch_ids = [d for _, d in dispatched]
    if dispatch_ids:
        ports.publisher.revoke(dispatch_ids)
    # The book's slots are free for the books waiting for them (their jobs stop within a poll).
    registry = ports.settings.registry
    for stage, slots in Counter(stage for (_, _, stage), _ in dispatched).items():
        if stage in registry:
            dispatch.hand_over(ports, registry.get(stage).queue, slots, exclude=book)
    log.info(
        "[COMMAND] book=%r cancelled commands=%d released=%d revoked=%d reason=%r",
        book,
        len(cancelled),
        released,
        len(dispatch_ids),
        why,
    )
    return {"book_id": book, "cancelled_commands": cancelled, "released": released, "revoked": len(dispatch_ids)}
