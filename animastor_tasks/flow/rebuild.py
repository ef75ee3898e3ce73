"""Redis's share of the state rebuilt from Postgres: the cancel flags of tombstoned books and the active index,
which makes each book put back in it due at once.

Reconcile rebuilds a slice of the books each pass and every book when Redis lost its data, which it knows by its
bookmark being gone. The tick looks for the same sign (`after_a_loss`) and rebuilds at once."""

from __future__ import annotations

import logging
from typing import Any

from animastor_tasks.ports import Ports

log = logging.getLogger("animastor.reconcile")
BOOKMARK = "reconcile"  # where reconcile's round of passes goes on
REBUILDING = "\x00rebuilding"  # the bookmark while a pass rebuilds every book (no book id holds a control character)
PAGE = 10_000  # scenes of a book's active index rebuilt at once


def rebuild(ports: Ports, indexed: list[str], report: dict[str, Any]) -> None:
    """Cancel flags of the tombstoned books a job could still run for (`Commands.tombstoned_books`: with work, or
    stopped lately); the active index of `indexed`."""
    tombstoned = ports.commands.tombstoned_books()
    ports.book_state.set_cancel_flags(tombstoned)
    if tombstoned:
        # A regenerate that deleted a tombstone after the read lifted its book's flag before the write set it again:
        # the flag of a book no longer tombstoned is lifted (a Stop All now is denied by its tombstone meanwhile).
        for book in set(tombstoned) - set(ports.commands.tombstoned_books()):
            ports.book_state.clear_mirror_flag(book)  # a Stop All's own flag, set since, stays
    # Page by page: the whole book's gate rows held at once took 1.1 GB and 10 s at a million pairs; and every
    # book in the same pages: a statement and a round trip per book were 6 of the 9 s of a farm of 5,000 books.
    rebuilt: set[str] = set()
    for page in ports.assets.in_flight_scene_pages(indexed, PAGE):
        ports.book_state.activate(page)
        rebuilt.update(page)
    report["rebuilt_books"] = report.get("rebuilt_books", 0) + len(rebuilt)


def after_a_loss(ports: Ports) -> None:
    """At each tick: no reconcile bookmark in Redis means it lost its data (a restart without persistence, a
    flush, a failover to an empty replica) or never held any; every book with work is then rebuilt into the active
    index, due now, and reconcile's round starts from its first book. *Why:* the lanes' waiting lists and the due
    index went with the data, so a freed slot was handed to nobody: both slots of a lane stood idle 24 s beside 12
    pending pairs until reconcile's next pass."""
    if ports.locks.bookmark(BOOKMARK) is not None:
        return
    ports.locks.set_bookmark(BOOKMARK, REBUILDING)  # read as none by a reconcile that starts meanwhile
    report: dict[str, Any] = {}
    rebuild(ports, sorted(ports.commands.books_with_work()), report)
    ports.locks.set_bookmark(BOOKMARK, "", kept=True)  # lost again meanwhile: the next tick rebuilds again
    if report["rebuilt_books"]:
        log.warning(
            "[RECONCILE] Redis held no reconcile bookmark (its data lost?): %d book(s) with work rebuilt into the"
            " active index, due now",
            report["rebuilt_books"],
        )
