"""Reconcile's turns over the books with work (domain/rounds.py): a bounded share per pass, every book in turn."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from animastor_tasks.domain.rounds import next_books


def test_a_farm_within_the_budget_is_passed_whole_every_time() -> None:
    work = {"b": 3, "a": 5, "c": 0}
    assert next_books(work, "", 8) == (["a", "b", "c"], "")
    assert next_books(work, "", 100) == (["a", "b", "c"], "")


def test_each_pass_goes_on_from_the_bookmark_and_the_round_starts_again_after_the_last_book() -> None:
    work = {"a": 4, "b": 4, "c": 4, "d": 4, "e": 1}
    assert next_books(work, "", 8) == (["a", "b"], "b")
    assert next_books(work, "b", 8) == (["c", "d"], "d")
    assert next_books(work, "d", 8) == (["e"], "")
    assert next_books(work, "", 8) == (["a", "b"], "b")


def test_a_book_bigger_than_the_budget_is_passed_alone() -> None:
    work = {"a": 1, "big": 1_000_000, "c": 1}
    assert next_books(work, "", 10) == (["a"], "a")
    assert next_books(work, "a", 10) == (["big"], "big")
    assert next_books(work, "big", 10) == (["c"], "")


def test_a_bookmark_whose_book_has_gone_resumes_at_the_next_id() -> None:
    work = {"a": 1, "c": 1, "e": 1}
    assert next_books(work, "b", 1) == (["c"], "c")
    assert next_books(work, "z", 1) == (["a"], "a")  # past the last book: the round starts again
    assert next_books({}, "b", 1) == ([], "")


@given(
    st.dictionaries(st.text(min_size=1, max_size=4), st.integers(min_value=0, max_value=50), max_size=30),
    st.integers(min_value=1, max_value=120),
)
def test_one_round_visits_every_book_once_within_the_budget(work: dict[str, int], budget: int) -> None:
    seen: list[str] = []
    bookmark = ""
    for _ in range(len(work) + 1):
        books, bookmark = next_books(work, bookmark, budget)
        assert len(books) == 1 or sum(work[b] for b in books) <= budget
        seen += books
        if not bookmark:
            break
    assert bookmark == "" and seen == sorted(work)
