"""A tick's batch holds its books' passes while it runs, and so does a regenerate its book's first pass; the tick
sends again the passes of a batch or a regenerate that died.

*Why:* control tasks are acknowledged when they start, so a batch lost with its control worker (killed by a deploy,
the kernel's OOM killer) took its books off the due index for nothing: they waited for reconcile's paged round,
12 runs (6 minutes) in a review's case, their GPU slots idle. A hold starts when the batch starts, not when the tick
sends it, so a control queue that is behind queues no pass twice; a thread renews it while the batch runs. A
regenerate killed after its commands were written and before its pass ended left its work to reconcile's round too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.ports import Ports

log = logging.getLogger("animastor.gate")

HOLD_SECONDS = 20.0  # how long a batch's books wait, once its worker died, before the tick sends their passes again


class PassHold:
    """The hold of one batch: written at its start, renewed every quarter of it by a thread of the batch's process
    (so a slow pass, or a slow read between two, never lets it lapse; it stops only with the process), let go as
    the batch ends. A store error ends the hold and costs no pass: the batch goes on, and a hold left behind
    lapses into one more pass of its books."""

    def __init__(self, ports: Ports, books: Sequence[str]) -> None:
        self._ports = ports
        self._held = list(dict.fromkeys(books))
        self._ended: list[str] = []
        self._lock = threading.Lock()  # the lists, between the passes and the renewing thread
        self._until: float | None = None  # the end last written
        self._broken = False
        self._stop = threading.Event()
        self._store(ports.clock() + HOLD_SECONDS)
        self._renewer = threading.Thread(target=self._renew, name="animastor-pass-hold", daemon=True)
        if not self._broken:
            self._renewer.start()

    def ended(self, book: str) -> None:
        """The pass of `book` is over (done, or failed and due again): its hold goes at the next write."""
        with self._lock:
            if book in self._held:
                self._held.remove(book)
                self._ended.append(book)

    def release(self) -> None:
        """The batch ended: every hold it wrote let go."""
        self._stop.set()
        if self._renewer.is_alive():
            self._renewer.join()
        self._store(None)

    def abandon(self) -> None:
        """The batch was cut short: its holds are left to lapse, and the tick sends its books' passes again."""
        self._stop.set()

    def _renew(self) -> None:
        while not self._stop.wait(HOLD_SECONDS / 4):
            self._store(self._ports.clock() + HOLD_SECONDS)

    def _store(self, until: float | None) -> None:
        if self._broken:
            return
        with self._lock:
            held, ended = list(self._held), list(self._ended)
        try:
            lost = self._ports.book_state.hold_passes(held, until, ended=ended, seen=self._until)
        except StoreUnavailable as err:
            self._broken = True
            log.warning("[COMMAND-GATE] hold of %d pass(es) not written: %s", len(held) + len(ended), err)
            return
        if lost:
            log.warning("[COMMAND-GATE] %d pass(es) of this batch outlived their hold: the tick sent them again", lost)
        with self._lock:
            self._ended = self._ended[len(ended) :]
        self._until = until


def let_go(ports: Ports, book: str, until: float) -> None:
    """The hold a regenerate wrote with its commands (`BookState.start_work`), let go after its first pass. Left
    behind (Redis refused this), it lapses into one more pass of the book."""
    try:
        ports.book_state.hold_passes([], None, ended=[book], seen=until)
    except StoreUnavailable as err:
        log.warning("[COMMAND] book=%r hold of its first pass not let go: %s", book, err)
