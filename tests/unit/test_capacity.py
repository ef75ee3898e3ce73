"""The capacity choice (lane limit, book quota, scene window, half-open permits) as a pure rule."""

from __future__ import annotations

from animastor_tasks.domain.capacity import CapacityCounts, choose, share_slots
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.vocabulary import Outcome

AUDIO = StageSpec(name="audio", queue="gpu.audio", input_field="text", media_type="audio/wav")
IMAGE = StageSpec(name="image", queue="gpu.image", input_field="prompt", media_type="image/png")


def spec(base: StageSpec, **limits: int) -> dict[str, StageSpec]:
    from dataclasses import replace

    return {base.name: replace(base, **limits)}


def wanted(*pairs: tuple[str, str, str]) -> list[tuple[tuple[str, str, str], str]]:
    return [(pair, f"d{i}") for i, pair in enumerate(pairs)]


def test_the_lane_limit_counts_every_book() -> None:
    counts = CapacityCounts(lane={"audio": 2}, book_generating=[])
    choice = choose(wanted(("c", "s1", "audio"), ("c", "s2", "audio")), counts, spec(AUDIO, lane_limit=3), {})
    assert choice.chosen == [(("c", "s1", "audio"), "d0")]
    assert choice.refused == {Outcome.LANE_FULL: [("c", "s2", "audio")]}


def test_the_book_quota_counts_the_books_own_generating_pairs() -> None:
    counts = CapacityCounts(lane={"audio": 1}, book_generating=[("c", "s0", "audio")])
    choice = choose(wanted(("c", "s1", "audio"), ("c", "s2", "audio")), counts, spec(AUDIO, book_quota=2), {})
    assert [pair for pair, _ in choice.chosen] == [("c", "s1", "audio")]
    assert choice.refused == {Outcome.QUOTA_EXHAUSTED: [("c", "s2", "audio")]}


def test_the_scene_window_spans_stages_and_a_scene_already_open_fits() -> None:
    specs = {**spec(AUDIO, window=2), **spec(IMAGE, window=2)}
    counts = CapacityCounts(lane={}, book_generating=[("c", "s1", "image")])
    choice = choose(wanted(("c", "s1", "audio"), ("c", "s2", "audio"), ("c", "s3", "audio")), counts, specs, {})
    assert [pair for pair, _ in choice.chosen] == [("c", "s1", "audio"), ("c", "s2", "audio")]
    assert choice.refused == {Outcome.WINDOW_FULL: [("c", "s3", "audio")]}


def test_a_half_open_breaker_allows_one_test_dispatch_and_defers_nothing() -> None:
    counts = CapacityCounts(lane={}, book_generating=[])
    choice = choose(wanted(("c", "s1", "audio"), ("c", "s2", "audio")), counts, spec(AUDIO), {"audio": 1})
    assert [pair for pair, _ in choice.chosen] == [("c", "s1", "audio")]
    assert choice.refused == {}  # the second waits for the breaker, not for capacity


def test_the_first_limit_hit_names_the_refusal() -> None:
    counts = CapacityCounts(lane={"audio": 5}, book_generating=[("c", "s0", "audio")])
    choice = choose(wanted(("c", "s1", "audio")), counts, spec(AUDIO, lane_limit=5, book_quota=1, window=1), {})
    assert choice.refused == {Outcome.LANE_FULL: [("c", "s1", "audio")]}


def test_the_room_of_one_freed_slot_takes_one_pair_and_the_rest_wait_for_the_lane() -> None:
    counts = CapacityCounts(lane={"audio": 1}, book_generating=[])
    pairs = wanted(("c", "s1", "audio"), ("c", "s2", "audio"), ("c", "s3", "audio"))
    choice = choose(pairs, counts, spec(AUDIO, lane_limit=8), {}, room={"audio": 1})
    assert [pair for pair, _ in choice.chosen] == [("c", "s1", "audio")]
    assert choice.refused == {Outcome.LANE_FULL: [("c", "s2", "audio"), ("c", "s3", "audio")]}
    assert choice.waits_for == {"audio"}  # the book queues for the lane's next freed slot


def test_slots_handed_together_are_shared_round_robin_head_first() -> None:
    assert share_slots(2, 2) == [1, 1]
    assert share_slots(5, 2) == [3, 2]  # fewer books than slots: the rest goes to them too, head first
    assert share_slots(3, 3) == [1, 1, 1]
    assert share_slots(4, 0) == []
    assert sum(share_slots(7, 3)) == 7
