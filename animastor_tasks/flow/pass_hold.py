"""A gate batch holds its books' passes while it runs, and a regenerate its book's first pass; the tick sends again
the passes whose holder's process died.

*Why:* control tasks are acknowledged when they start, so a batch lost with its control worker (killed by a deploy,
the kernel's OOM killer) took its books off the due index for nothing: they waited for reconcile's paged round,
12 runs (6 minutes) in a review's case, their GPU slots idle; a regenerate killed after its commands were written
and before its pass ended left its work to that round too. A hold starts when its holder starts, not when the tick
sends a batch, so a control queue that is behind queues no pass twice. Each holder has its own members
(`held_pass_member`): one letting go never takes another's hold away.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence

from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.ports import Ports

log = logging.getLogger("animastor.gate")

HOLD_SECONDS = 20.0  # how long a dead holder's books wait before the tick sends their passes again
STALL_SECONDS = 60.0  # a holder whose passes end none in this long is let lapse: the passes after a hung one go on


class PassHold:
    """One holder's hold: written as it starts (or with a regenerate's commands: `written`), renewed by this process's
    renewing thread every quarter of it (a slow pass never lets it lapse; it stops with the process), let go as the
    holder ends. A store error costs no pass: the holder goes on, the next renewal tries again, and a hold left
    behind lapses into one more pass of its books."""

    def __init__(self, ports: Ports, books: Sequence[str], *, holder: str | None = None, written: bool = False):
        self._ports = ports
        self.holder = holder or uuid.uuid4().hex
        self._held = list(dict.fromkeys(books))
        self._ended: list[str] = []
        self._lock = threading.Lock()  # the lists, between the holder's passes and the renewing thread
        self.renewed_at = self._progress = time.monotonic()
        self._stalled = self._released = False
        if not written:
            try:
                ports.book_state.hold_passes(self.holder, self._held, ports.clock() + HOLD_SECONDS)
            except StoreUnavailable as err:  # nothing held: a death now leaves these books to reconcile's round
                log.warning("[COMMAND-GATE] hold of %d pass(es) not written: %s", len(self._held), err)
                return
        _renewer().add(self)

    def ended(self, book: str) -> None:
        """The pass of `book` is over (done, or failed and due again): its hold goes at the next write."""
        with self._lock:
            if book in self._held:
                self._held.remove(book)
                self._ended.append(book)
            self._progress = time.monotonic()

    def release(self) -> None:
        """The holder ended: every hold it wrote let go."""
        _renewer().discard(self)
        with self._lock:
            books, self._held, self._ended = [*self._ended, *self._held], [], []
            self._released = True
        try:
            self._ports.book_state.let_go_passes(self.holder, books)
        except StoreUnavailable as err:
            log.warning("[COMMAND-GATE] hold of %d pass(es) not let go, to lapse into a pass: %s", len(books), err)

    def abandon(self) -> None:
        """The holder was cut short (its process is going): its holds lapse, and the tick sends its books again."""
        _renewer().discard(self)

    def renew(self) -> None:
        """Called by the renewing thread: held on, the ended let go; a holder stalled past `STALL_SECONDS` let lapse."""
        self.renewed_at = time.monotonic()
        with self._lock:
            held, ended = list(self._held), list(self._ended)
            stalled = self.renewed_at - self._progress > STALL_SECONDS
        if stalled:
            if not self._stalled:
                self._stalled = True
                log.warning("[COMMAND-GATE] no held pass ended in %.0f s: %d left to lapse", STALL_SECONDS, len(held))
            held = []
        try:
            lost = self._ports.book_state.renew_passes(
                self.holder, held, self._ports.clock() + HOLD_SECONDS, ended=ended
            )
        except StoreUnavailable as err:
            log.warning("[COMMAND-GATE] hold of %d pass(es) not renewed: %s", len(held), err)
            return
        with self._lock:
            self._ended = self._ended[len(ended) :]
            released = self._released
        if lost and not released:  # a release that came between took them away, not the tick
            log.warning("[COMMAND-GATE] %d held pass(es) had lapsed: the tick sent them again", lost)


class _Renewer:
    """One thread per process renews every hold of the process. *Why not one per holder:* a regenerate would start a
    thread before its first dispatch, on the latency's path."""

    def __init__(self) -> None:
        self._holds: set[PassHold] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        threading.Thread(target=self._loop, name="animastor-pass-holds", daemon=True).start()

    def add(self, hold: PassHold) -> None:
        with self._lock:
            self._holds.add(hold)
        self._wake.set()  # a shorter hold (tests) is renewed in time

    def discard(self, hold: PassHold) -> None:
        with self._lock:
            self._holds.discard(hold)

    def _loop(self) -> None:
        while True:
            self._wake.wait(min(1.0, HOLD_SECONDS / 8))
            self._wake.clear()
            with self._lock:
                holds = list(self._holds)
            for hold in holds:
                if time.monotonic() - hold.renewed_at >= HOLD_SECONDS / 4:
                    try:
                        hold.renew()
                    except Exception:  # one holder's fault must not end every hold's renewal in this process
                        log.exception("[COMMAND-GATE] hold of holder %s not renewed", hold.holder)


_renewers: dict[int, _Renewer] = {}  # by process: a forked pool process starts its own thread


def _renewer() -> _Renewer:
    pid = os.getpid()
    if pid not in _renewers:
        _renewers[pid] = _Renewer()
    return _renewers[pid]
