"""Which books one reconcile passes: a bounded share of the farm, taking turns.

Passing every book with work each time made reconcile's cost follow the whole farm: 16 s of a
control process every 30 s at a million pairs in flight (24 s in a slower hour, the length of the
beat's singleton lock: any bigger and the next pass starts beside it). Each pass now takes the next
books in id order up to a budget of pairs in flight; the round goes on from a bookmark and starts
again from the first book once it has reached the last one. A farm within the budget is passed
whole every time, as before."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping


def next_books(work: Mapping[str, int], after: str, budget: int) -> tuple[list[str], str]:
    """(the books this pass visits, the bookmark the next pass starts after): from the first book whose id
    follows `after` ("" or past the last book: the first book), books in id order while their pairs in flight
    (`work`) stay within `budget`, one book at least however big it is. The bookmark is "" once this pass
    reached the last book, so the next round starts from the first."""
    books = sorted(work)
    start = bisect_right(books, after) if after else 0
    if start >= len(books):
        start = 0
    chosen: list[str] = []
    pairs = 0
    for book in books[start:]:
        if chosen and pairs + work[book] > budget:
            break
        chosen.append(book)
        pairs += work[book]
    return chosen, "" if start + len(chosen) >= len(books) else chosen[-1]
