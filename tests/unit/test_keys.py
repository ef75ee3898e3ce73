from __future__ import annotations

import fnmatch
import gc
import tracemalloc
import uuid
from enum import Enum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from animastor_tasks.domain.keys import (
    Keyspace,
    encode,
    held_pass_member,
    pair_member,
    parse_pair_member,
    scene_member,
)

HOSTILE = st.text(
    alphabet=st.one_of(st.sampled_from(list(":*?[]\\ %/\n\t")), st.characters(codec="utf-8")),
    min_size=1,
    max_size=30,
)
keys = Keyspace("pfx")


@given(a=st.tuples(HOSTILE, HOSTILE, HOSTILE, HOSTILE), b=st.tuples(HOSTILE, HOSTILE, HOSTILE, HOSTILE))
def test_distinct_tuples_never_share_a_key(a: tuple[str, ...], b: tuple[str, ...]) -> None:
    if a != b:
        assert keys.lease(*a) != keys.lease(*b)


@given(t=st.tuples(HOSTILE, HOSTILE, HOSTILE, HOSTILE))
def test_every_key_parses_back_to_its_tuple(t: tuple[str, str, str, str]) -> None:
    assert keys.parse_lease(keys.lease(*t)) == t


@given(t=st.tuples(HOSTILE, HOSTILE, HOSTILE))
def test_pair_members_round_trip(t: tuple[str, str, str]) -> None:
    assert parse_pair_member(pair_member(*t)) == t


IDS = ["ch-1.2_~Z", "a:b", "é", "50%", "x y", "*", "s\n"]


@pytest.mark.parametrize("chapter", IDS)
@pytest.mark.parametrize("scene", IDS)
def test_a_pair_member_is_its_ids_encoded_whether_or_not_they_needed_it(chapter: str, scene: str) -> None:
    for stage in IDS:
        assert pair_member(chapter, scene, stage) == ":".join(encode(part) for part in (chapter, scene, stage))


@given(component=HOSTILE)
def test_encoded_component_has_no_separator_or_glob(component: str) -> None:
    encoded = encode(component)
    assert not set(encoded) & set(":*?[]\\ \n")
    assert encoded.isascii()


def test_book_a_b_chapter_c_differs_from_book_a_chapter_b_c() -> None:
    assert keys.lease("a:b", "c", "s", "audio") != keys.lease("a", "b:c", "s", "audio")
    assert scene_member("a:b", "c") != scene_member("a", "b:c")


@given(book=HOSTILE, other=HOSTILE)
def test_book_scan_pattern_matches_only_that_book(book: str, other: str) -> None:
    pattern = keys.book_pattern("lease", book)
    own = keys.lease(book, "c", "s", "audio")
    foreign = keys.lease(other, "c", "s", "audio")
    assert fnmatch.fnmatchcase(own, pattern)
    if other != book:
        assert not fnmatch.fnmatchcase(foreign, pattern)


def test_star_book_pattern_does_not_widen() -> None:
    pattern = keys.book_pattern("lease", "a*")
    assert not fnmatch.fnmatchcase(keys.lease("abc", "c", "s", "audio"), pattern)
    assert fnmatch.fnmatchcase(keys.lease("a*", "c", "s", "audio"), pattern)


def test_parse_rejects_foreign_keys() -> None:
    with pytest.raises(ValueError):
        keys.parse_lease("other:lease:a:b:c:d")
    with pytest.raises(ValueError):
        keys.parse_lease("pfx:lease:a:b:c")


def test_unknown_deferral_bucket_is_refused() -> None:
    with pytest.raises(ValueError, match="bucket"):
        keys.deferrals("b", "nope")
    with pytest.raises(ValueError, match="bucket"):
        keys.deferrals("b", "fence")  # no flow defers a fence rejection (domain/deferral.py)


def test_a_pair_member_of_a_str_subclass_is_its_text() -> None:
    class Stage(str, Enum):  # noqa: UP042 (the point: its format is "Stage.AUDIO", a StrEnum's its value)
        AUDIO = "audio"

    assert pair_member("c", "s", Stage.AUDIO) == "c:s:audio"


def test_ids_new_on_every_job_leave_nothing_behind() -> None:
    """A dispatch id (a batch's, a hold's holder) is new each time: its keys keep no memory once built (a GPU pool
    process grew 0.3 kB a job, each id cached)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(5000):
            dispatch_id = uuid.uuid4().hex
            keys.dispatch(dispatch_id), keys.running(dispatch_id), keys.queued(dispatch_id)
            keys.superseded(dispatch_id), keys.handing(dispatch_id), keys.counter_batch(dispatch_id)
            held_pass_member(dispatch_id, "b1")
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert kept < 50_000, f"{kept} bytes kept after 5,000 dispatch ids"
    assert keys.dispatch("a:b*") == "pfx:dispatch:a%3Ab%2A"  # an id that needs quoting is quoted still
    assert held_pass_member("h:1", "b:1") == "h%3A1:b%3A1"
