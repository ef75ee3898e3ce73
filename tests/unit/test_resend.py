"""A resent command_id is held to its first sending (domain/resend.py)."""

from __future__ import annotations

from animastor_tasks.domain.resend import FirstSending, named_match, resend_differs, spelled_out
from animastor_tasks.domain.vocabulary import Priority

FIRST = FirstSending("b1", frozenset({"audio"}), True, Priority.NORMAL, None)


def test_the_same_request_repeats_it() -> None:
    assert resend_differs(FIRST, "b1", ["audio"], True, Priority.NORMAL, False) is None
    # An older version's first sending: image may have been named with its layer off.
    assert resend_differs(FIRST, "b1", ["audio", "image"], True, Priority.NORMAL, False) is None


def test_each_change_is_named() -> None:
    assert resend_differs(FIRST, "b2", ["audio"], True, Priority.NORMAL, False) == "book_id"
    assert resend_differs(FIRST, "b1", ["image"], True, Priority.NORMAL, False) == "stages (first sent for audio)"
    assert resend_differs(FIRST, "b1", ["audio"], False, Priority.NORMAL, False) == "force (first sent with true)"
    assert resend_differs(FIRST, "b1", ["audio"], True, Priority.BULK, False) == "priority (first sent as normal)"
    other_scenes = FirstSending("b1", frozenset({"audio"}), True, Priority.NORMAL, False)
    assert resend_differs(other_scenes, "b1", ["audio"], True, Priority.NORMAL, False) == "scenes"


def test_named_scenes_match_only_as_the_same_set() -> None:
    named = [("ch1", "s1"), ("ch1", "s2"), ("ch1", "s1")]
    assert named_match(2, named, 2)
    assert not named_match(3, named, 2)  # the first sending had one more
    assert not named_match(2, named, 1)  # one named scene was not among them


ASKED = FirstSending("b1", frozenset({"audio"}), True, Priority.NORMAL, None, frozenset({"audio", "image"}), False)


def test_the_stages_asked_for_must_be_asked_again_whatever_commands_they_made() -> None:
    """Image's layer was off at the first sending: it made an audio command only, yet image was asked for."""
    assert resend_differs(ASKED, "b1", ["image", "audio"], True, Priority.NORMAL, False) is None
    assert (
        resend_differs(ASKED, "b1", ["audio"], True, Priority.NORMAL, False) == "stages (first sent for audio, image)"
    )
    only_audio = FirstSending("b1", frozenset({"audio"}), True, Priority.NORMAL, None, frozenset({"audio"}), False)
    assert (
        resend_differs(only_audio, "b1", ["audio", "image"], True, Priority.NORMAL, False)
        == "stages (first sent for audio)"
    )


def test_the_whole_book_and_named_scenes_are_different_requests() -> None:
    whole = FirstSending("b1", frozenset({"audio"}), True, Priority.NORMAL, None, frozenset({"audio"}), True)
    assert resend_differs(whole, "b1", ["audio"], True, Priority.NORMAL, True) is None
    assert (
        resend_differs(whole, "b1", ["audio"], True, Priority.NORMAL, False) == "scenes (first sent for the whole book)"
    )
    named = FirstSending("b1", frozenset({"audio"}), True, Priority.NORMAL, True, frozenset({"audio"}), False)
    assert resend_differs(named, "b1", ["audio"], True, Priority.NORMAL, True) == "scenes (first sent for named scenes)"
    unknown = FirstSending("b1", frozenset({"audio"}), True, Priority.NORMAL, None)  # an older version's
    assert resend_differs(unknown, "b1", ["audio"], True, Priority.NORMAL, True) is None


def test_all_is_spelled_out_as_the_stages_known_now() -> None:
    assert spelled_out(["all"], ["audio", "image"]) == {"audio", "image"}
    assert spelled_out(["image", "all"], ["audio", "image", "video"]) == {"audio", "image", "video"}
    assert spelled_out(["audio"], ["audio", "image"]) == {"audio"}
