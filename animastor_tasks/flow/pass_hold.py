"""A tick's batch holds its books' passes while it runs, and the tick sends again those of a batch that died.

*Why:* control tasks are acknowledged when they start, so a batch lost with its control worker (killed by a deploy,
the kernel's OOM killer) took its books off the due index for nothing: they waited for reconcile's paged round,
12 runs (6 minutes) in a review's case, their GPU slots idle. A hold starts when the batch starts, not when the tick
sends it, so a control queue that is behind queues no pass twice; a batch slower than its hold renews it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.ports import Ports

log = logging.getLogger("animastor.gate")

HOLD_SECONDS = 20.0  # how long a batch's books wait, once its worker died, before the tick sends their passes again


class PassHold:
    """The hold of one batch: written at its start, renewed when half spent, let go as it ends. A store error ends
    the hold and costs no pass: the batch goes on, and a hold left behind lapses into one more pass of its books."""

    def __init__(self, ports: Ports, books: Sequence[str]) -> None:
        self._ports = ports
        self._held = list(dict.fromkeys(books))
        self._ended: list[str] = []
        self._until: float | None = None  # the end this batch last wrote
        self._broken = False
        self._store(self._ports.clock() + HOLD_SECONDS)

    def ended(self, book: str) -> None:
        """The pass of `book` is over (done, or failed and due again)."""
        if book in self._held:
            self._held.remove(book)
            self._ended.append(book)
        if self._until is not None and self._ports.clock() >= self._until - HOLD_SECONDS / 2:
            self._store(self._ports.clock() + HOLD_SECONDS)

    def release(self) -> None:
        """The batch ended: every hold it wrote let go."""
        self._store(None)

    def _store(self, until: float | None) -> None:
        if self._broken:
            return
        try:
            self._ports.book_state.hold_passes(self._held, until, ended=self._ended, seen=self._until)
        except StoreUnavailable as err:
            self._broken = True
            log.warning("[COMMAND-GATE] hold of %d pass(es) not written: %s", len(self._held) + len(self._ended), err)
            return
        self._ended, self._until = [], until
