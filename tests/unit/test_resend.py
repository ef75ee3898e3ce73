"""A resent command_id is held to its first sending (domain/resend.py)."""

from __future__ import annotations

from animastor_tasks.domain.resend import FirstSending, named_match, resend_differs
from animastor_tasks.domain.vocabulary import Priority

FIRST = FirstSending("b1", frozenset({"audio"}), True, Priority.NORMAL, None)


def test_the_same_request_repeats_it() -> None:
    assert resend_differs(FIRST, "b1", ["audio"], True, Priority.NORMAL) is None
    assert resend_differs(FIRST, "b1", ["audio", "image"], True, Priority.NORMAL) is None  # image's layer was off


def test_each_change_is_named() -> None:
    assert resend_differs(FIRST, "b2", ["audio"], True, Priority.NORMAL) == "book_id"
    assert resend_differs(FIRST, "b1", ["image"], True, Priority.NORMAL) == "stages (first sent for audio)"
    assert resend_differs(FIRST, "b1", ["audio"], False, Priority.NORMAL) == "force (first sent with true)"
    assert resend_differs(FIRST, "b1", ["audio"], True, Priority.BULK) == "priority (first sent as normal)"
    other_scenes = FirstSending("b1", frozenset({"audio"}), True, Priority.NORMAL, False)
    assert resend_differs(other_scenes, "b1", ["audio"], True, Priority.NORMAL) == "scenes"


def test_named_scenes_match_only_as_the_same_set() -> None:
    named = [("ch1", "s1"), ("ch1", "s2"), ("ch1", "s1")]
    assert named_match(2, named, 2)
    assert not named_match(3, named, 2)  # the first sending had one more
    assert not named_match(2, named, 1)  # one named scene was not among them
