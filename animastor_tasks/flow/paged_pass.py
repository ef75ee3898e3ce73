"""The gate pass of a book with more pairs in flight than a pass holds at once (`page.PAGE`).

Its rows come from one statement through a server-side cursor, half a page at a time, and each read
holds what Redis knows of its own pairs only (`pair_snapshot`). The next rows are read (`read_ahead`)
while this read's snapshot is taken and decided, so a book of a million pairs costs the memory of one
page: the rows come from one statement's snapshot anyway, and facts read a little early are as safe as
a pass's own (see `gate._read_facts`). The lanes are counted again before each read after the first:
once they are full, the rest defer their pairs without a claim transaction. The book's finished scenes leave
the active index in reconcile's pass (dispatch_work off), through a scan of the index, not by
holding every scene of the book.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import wait

from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import page, read_ahead
from animastor_tasks.ports import GateRows, Ports, Snapshot

log = logging.getLogger("animastor.gate")
SCAN_SCENES = 1000  # active scenes checked per round trip when finished ones may be left in the index


def run(ports: Ports, report: page.PassReport, *, dispatch_work: bool, full_lanes: set[str], now: float) -> set[str]:
    """The pass, page by page; the lanes it took as full (counted without a lock), `full_lanes` included."""
    book = report.book
    queues = ports.settings.registry.queues()
    due: float | None = None
    due_at: float | None = None
    pages = 0
    try:
        for rows, snap in _pages(ports, book, now, queues):
            if pages == 0:
                due_at = snap.due_at
            elif dispatch_work:
                full_lanes = full_lanes | page.lanes_without_room(ports)
            pages += 1
            waiting, result = page.pass_rows(
                ports, report, snap, rows, dispatch_work=dispatch_work, full_lanes=full_lanes, now=now, keep_pairs=False
            )
            found = page.next_due(snap, waiting, result.deferred_until, now)
            due = min((d for d in (due, found) if d is not None), default=None)
        if not pages:  # an unknown book (its active index said it was big): off the indexes
            log.warning("[COMMAND-GATE] book=%r unknown; removed from the active index", book)
            _deactivate_finished(ports, book)
            ports.book_state.drop_book_if_idle(book)
        elif not dispatch_work:  # reconcile's pass, every book with work every 30 s: the counts cost a scan
            _deactivate_finished(ports, book)
        if pages:
            page.write_due(ports, book, due, due_at)
    except StoreUnavailable as err:
        report.error = str(err)
        log.warning(
            "[COMMAND-GATE] book=%r pass stopped after %d page(s), nothing more authorized: %s", book, pages, err
        )
    return full_lanes


def _pages(ports: Ports, book: str, now: float, queues: Sequence[str]) -> Iterator[tuple[GateRows, Snapshot]]:
    """The book's pages, each with its snapshot. The next page's rows are fetched while this one's snapshot is
    taken and the caller decides it. *Why:* one reader taking rows, then their snapshot, kept the pass waiting on
    both: 9.0 us a pair of a 100,000-pair book, against 5.6 for a book read in one page."""
    pages = ports.assets.gate_row_pages(book, page.PAGE // 2)  # one read ahead: a page's rows at most
    ahead = read_ahead.submit(lambda: next(pages, None))
    try:
        while (rows := ahead.result()) is not None:
            ahead = read_ahead.submit(lambda: next(pages, None))
            yield rows, ports.book_state.pair_snapshot(book, [i.pair for i in rows.in_flight], now, queues)
    finally:  # once the reader has stopped: the cursor is closed in this thread
        wait([ahead])
        pages.close()


def _deactivate_finished(ports: Ports, book: str) -> None:
    """Active scenes without a pair in flight leave the index; skipped when the counts say there are none."""
    if ports.book_state.active_scene_count(book) <= ports.assets.in_flight_scene_count(book):
        return
    for scenes in ports.book_state.scan_active(book, SCAN_SCENES):
        finished = set(scenes) - ports.assets.scenes_in_flight(book, scenes)
        if finished:
            ports.book_state.deactivate(book, finished)
