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
import math
import os
import threading
import time
import uuid
from collections.abc import Sequence

from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.ports import Ports

log = logging.getLogger("animastor.gate")

HOLD_SECONDS = 20.0  # how long a dead holder's books wait before the tick sends their passes again
STALL_SECONDS = 60.0  # a pass running this long gives the books after it in its batch to the next tick


class PassHold:
    """One holder's hold: written as it starts (or with a regenerate's commands: `written`), renewed by this process's
    renewing thread every quarter of it (a slow pass never lets it lapse; it stops with the process), let go as the
    holder ends. A store error costs no pass: the next renewal tries the write again (the first one's, a release's),
    and a hold left behind lapses into one more pass of its books. A pass running past `STALL_SECONDS` (a hung
    connection) gives the books after it to the next tick: held until they are due, then skipped; its own book
    stays held, its pass alive. A pass that ends forgets its book's lost passes (`domain/lost_passes.py`)."""

    def __init__(self, ports: Ports, books: Sequence[str], *, holder: str | None = None, written: bool = False):
        self._ports = ports
        self.holder = holder or uuid.uuid4().hex
        self._held = list(dict.fromkeys(books))  # in the order of their passes
        self._ended: list[str] = []  # whose members go at the next write
        self._passed: list[str] = []  # whose lost passes are forgotten at the next write
        self._given_up: set[str] = set()
        self._to_give: list[str] = []  # given up, still held until they are due
        self._lock = threading.Lock()  # all of the above, between the holder's passes and the renewing thread
        self.renewed_at = self._progress = time.monotonic()
        self._released = False
        self._write_by: float | None = None  # until when the renewing thread may write a hold a refusal kept back
        if not written:
            now = ports.clock()
            try:
                ports.book_state.hold_passes(self.holder, self._held, now + HOLD_SECONDS)
            except StoreUnavailable as err:  # a death before the renewal writes it leaves these books to reconcile
                log.warning("[COMMAND-GATE] hold of %d pass(es) not written yet: %s", len(self._held), err)
                # Later, a write whose answer was lost may have lapsed into a pass the tick sent again: written back,
                # that book's pass would run twice.
                self._write_by = now + HOLD_SECONDS / 2
        _renewer().add(self)

    def __enter__(self) -> PassHold:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """An error lets the holds go (sent again every hold, a pass failing the same way would run for ever); the
        process going (a BaseException: a shutdown cut the holder short) leaves them to lapse."""
        if kind is None or issubclass(kind, Exception):
            self.release()
        else:
            self.abandon()

    def gave_up(self, book: str) -> bool:
        """A stalled pass before it gave `book` to the tick."""
        with self._lock:
            return book in self._given_up

    def starts(self, book: str) -> bool:
        """The pass of `book` starts now, unless a stalled pass before it gave it to the tick (False)."""
        with self._lock:
            self._progress = time.monotonic()
            return book not in self._given_up

    def ended(self, book: str) -> None:
        """The pass of `book` is over (done, or failed and due again): its hold goes at the next write."""
        with self._lock:
            if book in self._held:
                self._held.remove(book)
                self._ended.append(book)
                self._passed.append(book)
            self._progress = time.monotonic()

    def release(self) -> None:
        """The holder ended: every hold it wrote let go (tried again by the renewing thread should Redis refuse)."""
        with self._lock:  # books given up whose due write failed stay held: the renewing thread writes it
            self._ended += [b for b in self._held if b not in self._to_give]
            self._held, self._released = [b for b in self._held if b in self._to_give], True
            ended, passed = list(self._ended), list(self._passed)
        try:
            self._ports.book_state.let_go_passes(self.holder, ended, passed=passed)
        except StoreUnavailable as err:
            log.warning("[COMMAND-GATE] hold of %d pass(es) not let go yet: %s", len(ended), err)
            return
        if self._written(ended, passed):
            _renewer().discard(self)

    def abandon(self) -> None:
        """The holder was cut short (its process is going): its holds lapse, and the tick sends its books again."""
        _renewer().discard(self)

    def renew(self) -> None:
        """Called by the renewing thread: held on, the ended let go, the books after a stalled pass given up."""
        self.renewed_at = time.monotonic()
        with self._lock:
            waiting = [b for b in self._held if b not in self._given_up]
            if self.renewed_at - self._progress > STALL_SECONDS and len(waiting) > 1:
                running, *after = waiting  # passes run in the held order: the first of them is the one running
                self._given_up.update(after)
                self._to_give += after
                log.warning(
                    "[COMMAND-GATE] book=%r pass has run %.0f s (holder %s): the %d book(s) after it go to the tick",
                    running, STALL_SECONDS, self.holder, len(after),
                )  # fmt: skip
            to_give = list(self._to_give)
        if to_give and self._give_to_tick(to_give):
            with self._lock:
                self._held = [b for b in self._held if b not in to_give]
                self._ended += to_give
                self._to_give = [b for b in self._to_give if b not in to_give]
        until = self._ports.clock() + HOLD_SECONDS
        with self._lock:
            held, ended, passed = list(self._held), list(self._ended), list(self._passed)
        first = self._write_by
        if first is not None and (not self._write_first(held, until, first) or not (ended or passed)):
            return  # not written, or written and nothing more to write
        try:
            lost = self._ports.book_state.renew_passes(self.holder, held, until, ended=ended, passed=passed)
        except StoreUnavailable as err:
            log.warning("[COMMAND-GATE] hold of %d pass(es) not renewed: %s", len(held), err)
            return
        if self._written(ended, passed):  # a release whose write failed: done now
            _renewer().discard(self)
        elif lost and not self._released:  # a release that came between took them away, not the tick
            log.warning("[COMMAND-GATE] %d held pass(es) had lapsed: the tick sent them again", lost)

    def _write_first(self, held: list[str], until: float, write_by: float) -> bool:
        """The hold a refusal kept from being written as the holder started: written now (never taken by the tick,
        so written, not only renewed), while no answer lost with an earlier write can have lapsed into a pass the
        tick sent again. Too late, the holder holds nothing: a death leaves its books to reconcile's round."""
        if self._ports.clock() >= write_by:
            if write_by > -math.inf:
                log.warning("[COMMAND-GATE] hold of %d pass(es) never written: left to reconcile", len(held))
                self._write_by = -math.inf
            return False
        try:
            self._ports.book_state.hold_passes(self.holder, held, until)
        except StoreUnavailable as err:
            log.warning("[COMMAND-GATE] hold of %d pass(es) not written yet: %s", len(held), err)
            return False
        with self._lock:
            self._write_by = None
            # Passes that ended since `held` was read: their members go (again: a release may have taken them away
            # before this write put them back), and a holder released meanwhile is renewed once more to do it.
            late = [b for b in held if b not in self._held]
            self._ended += late
            released = self._released
        if late and released:
            _renewer().add(self)
        return True

    def _written(self, ended: list[str], passed: list[str]) -> bool:
        """The members and counts just written taken off the lists; whether the holder is released and done."""
        with self._lock:
            self._ended = self._ended[len(ended) :]
            self._passed = self._passed[len(passed) :]
            return self._released and not self._ended and not self._held

    def _give_to_tick(self, books: list[str]) -> bool:
        try:
            self._ports.book_state.set_due_all(books, self._ports.clock())
        except StoreUnavailable as err:  # still held: the next renewal tries again
            log.warning("[COMMAND-GATE] %d book(s) after a stalled pass not made due yet: %s", len(books), err)
            return False
        return True


class _Renewer:
    """One thread per process renews every hold of the process. *Why not one per holder:* each regenerate would start
    a thread before its first dispatch, on the latency's path (this one starts with the process's first hold)."""

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
_renewers_lock = threading.Lock()  # a threads pool's processes ask for it at once


def _renewer() -> _Renewer:
    pid = os.getpid()
    with _renewers_lock:
        if pid not in _renewers:
            _renewers[pid] = _Renewer()
        return _renewers[pid]
