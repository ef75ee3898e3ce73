"""Issue 7, item 12: hostile ids (`:`, `*`, `?`, `[`, `]`, `\\`, `%`, spaces, newlines, 4 KB, non-ASCII)
through import, regenerate and cancel, in-process against the real stores (no workers: a consumer is
advertised the way a worker's heartbeat does, so dispatch really claims, leases and publishes).

Accepted ids never collide and never leak into another book's keys: every Redis key under our prefix is
parsed here, with our own split and percent-decoding, and each book component, pair member, scene member,
lease and dispatch record must name a book, scene and pair that exist and belong together. Refused ids get
a clear error naming the field (InvalidBook / InvalidCommand), decided against an independent oracle of the
documented id rules. A cancel of one book touches no other book: the others' Redis keys and Postgres
states are byte-for-byte what they were, even for the glob family `a*`, `ab`, `a`, `a**`.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from animastor_tasks.domain.book import Book, parse_book
from animastor_tasks.errors import InvalidBook, InvalidCommand
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring
from tests.conftest import TABLES

from .scale import current as current_scale

pytestmark = pytest.mark.faults

QUEUES = ["gpu.audio", "gpu.image"]
BIDI_AND_BOM = set("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\ufeff")
PER_BOOK_KINDS = {"cancel": 1, "lifting": 1, "layers": 1, "force": 1, "active": 1, "defer": 2, "lease": 4}
OTHER_KINDS = {
    "active-books",
    "dispatch",
    "running",
    "queued",
    "consumers",
    "lane-waiters",
    "lane-handed",
    "breaker",
    "lock",
    "metrics",
    "metrics-batch",
    "epoch",
    "beats",
    "handing",
    "superseded",
    "lanes-seen-free",
    "held",
    "stops-sent",
    "voided-requests",
}
EXAMPLES = current_scale().pick(60, 500)

HOSTILE = ":*?[]\\% /aAé漢😀"
accepted_id = st.text(alphabet=st.sampled_from(list(HOSTILE)), min_size=1, max_size=12).filter(str.strip)
refused_id = st.one_of(
    st.builds(lambda a, b: f"{a}\n{b}", accepted_id, accepted_id),  # a newline (control character)
    st.builds(lambda a: (a * 4096)[:4096], accepted_id),  # 4 KB
    st.sampled_from(["", "   ", "a\u202eb", "a\u2028b", "\x00", "tab\there"]),
)
any_id = st.one_of(accepted_id, accepted_id, accepted_id, refused_id)


def id_refusal(value: str) -> str | None:
    """The documented id rules (docs/book-format.md), written independently of the product's validator."""
    if not value.strip():
        return "must not be empty or whitespace-only"
    if len(value) > 200:
        return "must be at most 200 characters"
    for ch in value:
        if ch in BIDI_AND_BOM or unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp"):
            return "must not contain"
    return None


def book_doc(book_id: str, chapters: list[tuple[str, list[str]]]) -> dict[str, Any]:
    return {
        "book_id": book_id,
        "title": "hostile",
        "chapters": [
            {
                "chapter_id": chapter,
                "title": "c",
                "scenes": [{"scene_id": s, "text": f"text {i}", "prompt": f"prompt {i}"} for i, s in enumerate(scenes)],
            }
            for chapter, scenes in chapters
        ],
    }


def first_refusal(doc: dict[str, Any]) -> tuple[str, str] | None:
    """(field path, rule) of the first id the oracle refuses, in document order."""
    if (why := id_refusal(doc["book_id"])) is not None:
        return "book_id", why
    for c, chapter in enumerate(doc["chapters"]):
        if (why := id_refusal(chapter["chapter_id"])) is not None:
            return f"chapters[{c}].chapter_id", why
        for s, scene in enumerate(chapter["scenes"]):
            if (why := id_refusal(scene["scene_id"])) is not None:
                return f"chapters[{c}].scenes[{s}].scene_id", why
    return None


def reset(rt: Wiring) -> None:
    """Clean stores between hypothesis examples (the `rt` fixture cleans only once per test)."""
    with rt.db.transaction() as conn:
        conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    rt.redis.client.flushdb()
    rt.presence.heartbeat("w@h", QUEUES, 60)


# ---------------------------------------------------------------------------------------------------------------
# Reading every key back, with our own parser.


def scan_keys(rt: Wiring) -> dict[str, Any]:
    """{key: its content} for every key under our prefix (Celery's broker keys have no prefix)."""
    client = rt.redis.client
    found: dict[str, Any] = {}
    for key in client.scan_iter(match=f"{rt.settings.key_prefix}:*", count=1000):
        kind = client.type(key)
        if kind == "string":
            found[key] = client.get(key)
        elif kind == "set":
            found[key] = sorted(client.smembers(key))
        elif kind == "zset":
            found[key] = sorted(m for m, _ in client.zrange(key, 0, -1, withscores=True))
        elif kind == "hash":
            found[key] = dict(sorted(client.hgetall(key).items()))
        else:
            found[key] = kind
    return found


def book_of(rt: Wiring, key: str) -> str | None:
    """The decoded book a per-book key names (None for keys that are not per book)."""
    head, _, rest = key.partition(":")
    assert head == rt.settings.key_prefix, key
    kind, _, tail = rest.partition(":")
    if kind in OTHER_KINDS:
        return None
    assert kind in PER_BOOK_KINDS, f"unknown key kind {kind!r}: {key!r}"
    parts = tail.split(":")
    assert len(parts) == PER_BOOK_KINDS[kind], f"{key!r}: {len(parts)} components for a {kind} key"
    for part in parts:  # encoded components hold no separator and no glob character
        assert not set(part) & set(":*?[]\\ \n"), f"{key!r}: raw character in component {part!r}"
    return unquote(parts[0])


def check_keys(rt: Wiring, books: dict[str, Book]) -> dict[str, Any]:
    """Every key belongs to a known book, and everything inside it to that same book."""
    keys = scan_keys(rt)
    stages = ("audio", "image")
    pairs = {b: {(s.chapter_id, s.scene_id, st) for s in book.scenes for st in stages} for b, book in books.items()}
    scenes = {b: {s.key for s in book.scenes} for b, book in books.items()}
    prefix = rt.settings.key_prefix
    for key, content in keys.items():
        kind = key.split(":", 2)[1]
        book = book_of(rt, key)
        if book is not None:
            assert book in books, f"{key!r} names book {book!r}, which was never imported (collision or leak)"
        if kind in ("force", "defer"):
            for member in content:
                parts = member.split(":")
                assert len(parts) == 3, (key, member)
                pair = (unquote(parts[0]), unquote(parts[1]), unquote(parts[2]))
                assert pair in pairs[book], f"{key!r} holds {pair!r}, not a pair of book {book!r}"
        elif kind == "active":
            for member in content:
                parts = member.split(":")
                assert len(parts) == 2, (key, member)
                assert (unquote(parts[0]), unquote(parts[1])) in scenes[book], (key, member)
        elif kind == "lease":
            _, _, c, s, st = (unquote(p) for p in key[len(prefix) + 1 :].split(":"))
            assert (c, s, st) in pairs[book], key
            owner = _asset(rt, book, (c, s, st))
            assert owner == ("generating", content), f"{key!r} holds {content!r}, the pair is {owner}"
        elif kind == "dispatch":
            dispatch_id = unquote(key.split(":", 2)[2])
            pair = (content["chapter"], content["scene"], content["stage"])
            assert content["book"] in books and pair in pairs[content["book"]], (key, content)
            assert _journaled(rt, content["book"], pair, dispatch_id), f"{key!r}: no such dispatch of {content}"
        elif kind in ("active-books", "stops-sent"):
            assert set(content) <= set(books), (key, content)
    return keys


def _journaled(rt: Wiring, book: str, pair: tuple[str, str, str], dispatch_id: str) -> bool:
    with rt.db.read() as conn:
        row = conn.execute(
            "SELECT 1 FROM events WHERE kind = 'dispatch' AND book_id = %s AND chapter_id = %s AND scene_id = %s"
            " AND stage = %s AND dispatch_id = %s",
            (book, *pair, dispatch_id),
        ).fetchone()
    return row is not None


def _asset(rt: Wiring, book: str, pair: tuple[str, str, str]) -> tuple[str, str] | None:
    with rt.db.read() as conn:
        row = conn.execute(
            "SELECT state, dispatch_id FROM asset_states WHERE book_id = %s AND chapter_id = %s AND scene_id = %s"
            " AND stage = %s",
            (book, *pair),
        ).fetchone()
    return None if row is None else (row[0], row[1])


def pg_states(rt: Wiring, books: Iterable[str]) -> dict[str, list[tuple[Any, ...]]]:
    out = {}
    with rt.db.read() as conn:
        for book in books:
            out[book] = [
                tuple(r)
                for r in conn.execute(
                    "SELECT chapter_id, scene_id, stage, state, fencing_token, dispatch_id, updated_at"
                    " FROM asset_states WHERE book_id = %s ORDER BY 1, 2, 3",
                    (book,),
                )
            ]
            out[book].extend(
                tuple(r)
                for r in conn.execute(
                    "SELECT command_id::text, stage, status, updated_at FROM commands WHERE book_id = %s ORDER BY 1",
                    (book,),
                )
            )
    return out


def cancel_touches_no_other_book(rt: Wiring, books: dict[str, Book], victim: str) -> None:
    before = check_keys(rt, books)
    others = [b for b in books if b != victim]
    pg_before = pg_states(rt, others)
    answer = cancel_flow.cancel(rt.ports, victim, reason="hostile")
    assert answer["book_id"] == victim
    after = check_keys(rt, books)
    for key in set(before) | set(after):
        book = book_of(rt, key)
        if book is not None and book != victim:
            assert before.get(key) == after.get(key), f"cancel of {victim!r} changed {key!r} of book {book!r}"
    assert pg_states(rt, others) == pg_before, f"cancel of {victim!r} changed another book in Postgres"
    left = {key for key in after if book_of(rt, key) == victim}
    kinds = {key.split(":", 2)[1] for key in left}
    assert kinds <= {"cancel", "lifting", "layers"}, f"{victim!r} still has {sorted(left)} after its cancel"
    assert rt.ports.book_state.cancel_flag_set(victim) and victim not in rt.ports.book_state.active_books()
    with rt.db.read() as conn:
        busy = conn.execute(
            "SELECT count(*) FROM asset_states WHERE book_id = %s AND state IN ('pending', 'generating')", (victim,)
        ).fetchone()[0]
    assert busy == 0


# ---------------------------------------------------------------------------------------------------------------


book_shapes = st.lists(
    st.tuples(
        any_id,
        st.lists(st.tuples(any_id, st.lists(any_id, min_size=1, max_size=2, unique=True)), min_size=1, max_size=2),
    ),
    min_size=2,
    max_size=3,
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(shapes=book_shapes, data=st.data())
def test_hostile_ids_through_import_regenerate_and_cancel(rt, shapes, data) -> None:
    reset(rt)
    accepted: dict[str, Book] = {}
    refused = 0
    for book_id, chapters in shapes:
        unique_chapters = list({c: scenes for c, scenes in chapters}.items())
        doc = book_doc(book_id, unique_chapters)
        oracle = first_refusal(doc)
        try:
            book = parse_book(doc)
        except InvalidBook as err:
            assert oracle is not None, f"a valid document was refused: {err}"
            field, rule = oracle
            assert str(err).startswith(f"{field}: {rule}"), f"error {err} does not name {field} ({rule})"
            refused += 1
            continue
        assert oracle is None, f"{oracle} should have been refused: {doc!r}"
        if book.book_id in accepted:
            continue  # the same id drawn twice: a re-import, not a new book
        rt.catalog.import_book(book)
        accepted[book.book_id] = book

    for book in accepted.values():
        result = regenerate_flow.regenerate(rt.ports, book.book_id, ["all"])
        assert {c["stage"] for c in result["commands"]} == {"audio", "image"}
        # A refused scene id names its field; nothing is written for it.
        bad = data.draw(refused_id, label="refused scene id")
        with pytest.raises(InvalidCommand, match=r"^scenes\[0\]\[1\]: "):
            regenerate_flow.regenerate(rt.ports, book.book_id, ["audio"], [[book.scenes[0].chapter_id, bad]])
        # A hostile id of a book that does not exist (a glob that would match this one) is unknown.
        for ghost in (book.book_id + "*", book.book_id[:-1] + "?", f"[{book.book_id}]"):
            if ghost not in accepted and id_refusal(ghost) is None:
                with pytest.raises(InvalidCommand, match=r"^book_id: unknown book"):
                    regenerate_flow.regenerate(rt.ports, ghost, ["audio"])
    check_keys(rt, accepted)
    if accepted:
        victim = data.draw(st.sampled_from(sorted(accepted)), label="cancelled book")
        cancel_touches_no_other_book(rt, accepted, victim)
    with rt.db.read() as conn:
        assert {r[0] for r in conn.execute("SELECT book_id FROM books")} == set(accepted)
        assert conn.execute("SELECT count(*) FROM commands").fetchone()[0] == 2 * len(accepted)


GLOB_FAMILY = ["a*", "ab", "a", "a**", "a?", "[a]", "a%2A", "a:b", "a\\"]


def test_cancel_of_a_glob_book_touches_no_other_book(rt, figure) -> None:
    reset(rt)
    books: dict[str, Book] = {}
    for book_id in GLOB_FAMILY:
        chapters = [("c*", ["s", "s*"]), ("c", ["s:1", "s"])]
        book = parse_book(book_doc(book_id, chapters))
        rt.catalog.import_book(book)
        books[book_id] = book
        regenerate_flow.regenerate(rt.ports, book_id, ["all"])
    keys = check_keys(rt, books)
    per_book = {b: sum(1 for k in keys if book_of(rt, k) == b) for b in books}
    assert all(n >= 3 for n in per_book.values()), per_book  # force set, active scenes, leases at least
    client: redis.Redis = rt.redis.client
    match = rt.redis.keys.book_pattern("lease", "a*")
    assert {unquote(k.split(":")[2]) for k in client.scan_iter(match=match)} == {"a*"}
    cancel_touches_no_other_book(rt, books, "a*")
    cancel_flow.cancel(rt.ports, "a*", reason="again")  # idempotent, still scoped
    cancel_touches_no_other_book(rt, books, "a")
    figure(
        f"trials {len(GLOB_FAMILY)} books {GLOB_FAMILY}: {sum(per_book.values())} per-book keys checked; cancel "
        f"of 'a*' then 'a' changed 0 keys and 0 Postgres rows of the other books; lost 0, duplicated 0 "
        f"(every key decodes to its own book); hypothesis examples per run: {EXAMPLES}"
    )
