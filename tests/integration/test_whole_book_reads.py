"""The repairs read what they repair, not the whole book: a dead job's takeover reads its pairs by key and
reconcile rebuilds the active index page by page. Each held the book's every in-flight pair at once: 10 s and
1.1 GB of a control process at a million pairs. Real Postgres and Redis."""

from __future__ import annotations

import pytest

from animastor_tasks.domain.vocabulary import AssetState
from animastor_tasks.flow import rebuild, takeover
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, lose_leases, make_book, read_calls, states


def _regenerated(rt: Wiring, book: str, scenes: int) -> None:
    rt.catalog.import_book(make_book(book, chapters=2, scenes=scenes))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, book, ["audio"])


def test_the_gate_rows_of_some_pairs_are_those_of_the_whole_read(rt: Wiring) -> None:
    _regenerated(rt, "b", scenes=5)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch2", "s5"]], priority="interactive")
    whole = rt.ports.assets.gate_rows("b")
    assert whole is not None
    picked = [("ch1", "s1", "audio"), ("ch2", "s5", "audio"), ("ch1", "s1", "image")]  # the last: not in flight
    some = rt.ports.assets.gate_rows("b", picked)
    assert some is not None
    assert (some.layers_raw, some.tombstone) == (whole.layers_raw, whole.tombstone)
    assert set(some.in_flight) == {i for i in whole.in_flight if i.pair in picked}
    assert len(some.in_flight) == 2 and some.commanded == frozenset(picked[:2])
    assert rt.ports.assets.gate_rows("gone", picked) is None


def test_a_dead_jobs_takeover_reads_the_facts_of_its_pairs_only(rt: Wiring) -> None:
    _regenerated(rt, "b", scenes=40)
    dead = [g for g in rt.ports.assets.generating_pairs() if g.book == "b"][:2]
    assert len(dead) == 2
    lose_leases(rt, [(g.book, *g.pair) for g in dead])  # their jobs died: what the takeover expires
    calls = read_calls(rt, "gate_rows")
    report = {"expired": 0}
    takeover.expire(rt.ports, dead, report)
    assert calls == [("b", [g.pair for g in dead])]  # one read, of the two pairs
    assert report["expired"] == 2
    assert {states(rt, "b")[g.pair] for g in dead} == {AssetState.PENDING}  # still commanded: back to pending


def test_reconcile_rebuilds_the_active_index_page_by_page(rt: Wiring, monkeypatch: pytest.MonkeyPatch) -> None:
    _regenerated(rt, "b", scenes=5)
    in_flight = {p[:2] for p, state in states(rt, "b").items() if state in ("pending", "generating")}
    assert len(in_flight) == 10
    pages = [page["b"] for page in rt.ports.assets.in_flight_scene_pages(["b"], 3)]
    assert [len(p) for p in pages] == [3, 3, 3, 1] and {s for p in pages for s in p} == in_flight
    rt.redis.client.delete(rt.redis.keys.active_scenes("b"))  # lost, as with Redis's data
    monkeypatch.setattr(rebuild, "PAGE", 3)
    calls = read_calls(rt, "gate_rows")
    assert reconcile_flow.reconcile(rt.ports, force=True)["rebuilt_books"] == 1
    assert calls == []  # the whole book's rows are read by its pass alone, page by page
    active = rt.redis.client.smembers(rt.redis.keys.active_scenes("b"))
    assert len(active) == 10


def test_reconcile_reads_its_books_facts_several_books_at_a_time(rt: Wiring) -> None:
    """Its rebuild of each book's active index and its pass of each book with work read that book alone: 6 and
    3 of the 9 s of a reconcile of 5,000 books of 20 pairs. The rebuild reads every book's scenes in the same
    pages, the passes read facts as the tick's batches do, and each book is still judged: pending pairs whose
    commands ended behind the flows' back are released."""
    books = [f"b{n:02d}" for n in range(12)]
    for book in books:
        _regenerated(rt, book, scenes=3)
    with rt.db.transaction() as conn:  # every command of the even books ended without its flow's cleanup
        conn.execute("UPDATE commands SET status = 'cancelled' WHERE book_id = ANY(%s)", (books[::2],))

    def pending() -> dict[str, int]:
        return {book: sum(s == AssetState.PENDING for s in states(rt, book).values()) for book in books}

    before = pending()
    active = {book: rt.redis.client.smembers(rt.redis.keys.active_scenes(book)) for book in books}
    rt.redis.client.delete(*[rt.redis.keys.active_scenes(book) for book in books])  # lost, as with Redis's data
    calls = read_calls(rt, "gate_rows_many", "gate_rows", "release_denied")
    rebuilds = read_calls(rt, "in_flight_scene_pages")
    report = reconcile_flow.reconcile(rt.ports, force=True)
    # Two statements for twelve books, and a release by each book that releases pairs, decided again under the
    # book's lock on the facts of that moment (`Assets.release_denied`: a read by key of those pairs).
    assert sorted(len(c[0]) for c in calls if not isinstance(c[0], str)) == [2, 10]
    assert sorted(c[0] for c in calls if isinstance(c[0], str)) == [book for book in books[::2] if before[book]]
    assert [sorted(c[0]) for c in rebuilds] == [books]  # and one for their active scenes
    assert report["rebuilt_books"] == len(books)
    assert {book: rt.redis.client.smembers(rt.redis.keys.active_scenes(book)) for book in books[1::2]} == {
        book: active[book] for book in books[1::2]
    }
    after = pending()
    assert report["released"] == sum(before[book] for book in books[::2]) > 0
    assert all(after[book] == 0 for book in books[::2]), after
    assert all(after[book] == before[book] > 0 for book in books[1::2]), (before, after)
