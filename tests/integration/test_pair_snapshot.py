"""A pass's read of its own pairs (`BookState.pair_snapshot`, one Lua call that names each pair once) says
what the whole book's read (`book_snapshots`) says of those pairs: forced, deferred in which bucket while
the deferral lasts, and the first deferral end. Real Redis; more pairs than Lua can unpack at once (8,000)."""

from __future__ import annotations

import re
import time

import pytest

from animastor_tasks.domain.keys import DEFER_BUCKETS, pair_member
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.worker.wiring import Wiring

BOOK = "bo:ok*"


def test_a_pages_snapshot_says_what_the_books_says_of_its_pairs(rt: Wiring) -> None:
    stages = ("audio", "image")
    pairs = [(f"ch {n // 100}", f"s:{n}%", stage) for n in range(4500) for stage in stages]
    now = rt.ports.clock()
    client, keys = rt.redis.client, rt.redis.keys
    client.sadd(keys.force_set(BOOK), *[pair_member(*p) for p in pairs[::7]])
    for n, bucket in enumerate(DEFER_BUCKETS):
        # In each bucket: a third of the pairs deferred past now, each with its own end, and some that lapsed.
        client.zadd(keys.deferrals(BOOK, bucket), {pair_member(*p): now + 10 + i for i, p in enumerate(pairs[n::3])})
        client.zadd(keys.deferrals(BOOK, bucket), {pair_member(*p): now - 5 for p in pairs[n + 1 :: 11]})
    asked = pairs[3:8800]  # not every pair of the book: what it says of the others is not this read's
    whole = rt.ports.book_state.book_snapshots([BOOK], now)[BOOK]
    snap = rt.ports.book_state.pair_snapshot(BOOK, asked, now, [])
    assert snap.force == whole.force & set(asked) and len(snap.force) > 1200
    for bucket in DEFER_BUCKETS:
        assert snap.deferred[bucket] == whole.deferred[bucket] & set(asked), bucket
        assert len(snap.deferred[bucket]) > 2500
    assert snap.first_deferral_end == now + 10 + 1  # pairs[3] is the second of the first bucket's
    assert rt.ports.book_state.pair_snapshot(BOOK, [], now, []).force == set()


def test_a_deferral_that_ends_is_not_read_as_one(rt: Wiring) -> None:
    pair = ("c", "s", "audio")
    now = rt.ports.clock()
    rt.deferrals.defer("b", DEFER_BUCKETS[0], [pair], 0.5, now)
    assert rt.ports.book_state.pair_snapshot("b", [pair], now, []).deferred[DEFER_BUCKETS[0]] == {pair}
    time.sleep(0.6)
    later = rt.ports.book_state.pair_snapshot("b", [pair], rt.ports.clock(), [])
    assert later.deferred[DEFER_BUCKETS[0]] == set() and later.first_deferral_end is None


def test_a_key_of_another_type_is_named_in_the_error(rt: Wiring) -> None:
    key = rt.redis.keys.deferrals("b", DEFER_BUCKETS[-1])
    rt.redis.client.set(key, "not a sorted set")
    with pytest.raises(StoreUnavailable, match=f"WRONGTYPE .*\\(ZMSCORE {re.escape(key)}\\)"):
        rt.ports.book_state.pair_snapshot("b", [("c", "s", "audio")], rt.ports.clock(), [])
