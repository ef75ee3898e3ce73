"""The capacity choice (lane limit, book quota, scene window, half-open permits) as a pure rule."""

from __future__ import annotations

from dataclasses import replace

from animastor_tasks.domain.capacity import CapacityCounts, Waiter, choose, share_slots, waited_longer
from animastor_tasks.domain.deferral import SERVED_AFTER
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


INTERACTIVE, NORMAL, BULK = 0, 1, 2


def test_the_fair_share_binds_only_for_waiters_at_least_as_urgent_as_the_pair() -> None:
    """Old code: any waiter below its share bound the share, so a reader's interactive scene of a book at its share
    was refused while a bulk book waited, and the slot went to the bulk book."""
    running = [("c", f"s{i}", "audio") for i in range(4)]
    pairs = wanted(("c", "s50", "audio"))
    limits = spec(AUDIO, lane_limit=8, book_quota=4, window=10)
    bulk_waits = CapacityCounts(lane={"audio": 7}, book_generating=running, waiting={"audio": [Waiter(BULK, [])]})
    choice = choose(pairs, bulk_waits, limits, {}, ranks={("c", "s50", "audio"): INTERACTIVE})
    assert [pair for pair, _ in choice.chosen] == [("c", "s50", "audio")]
    reader_waits = replace(bulk_waits, waiting={"audio": [Waiter(INTERACTIVE, [])]})
    choice = choose(pairs, reader_waits, limits, {}, ranks={("c", "s50", "audio"): INTERACTIVE})
    assert choice.refused == {Outcome.QUOTA_EXHAUSTED: [("c", "s50", "audio")]}


def test_a_pair_does_not_take_a_slot_a_more_urgent_book_below_its_share_waits_for() -> None:
    """Old code: the book's interactive scene was refused by its window and its bulk scene already in flight took
    the slot, while another reader's interactive scene waited for the lane."""
    specs = {**spec(AUDIO, window=4), **spec(IMAGE, window=4)}
    running = [("c", f"s{i}", "audio") for i in range(1, 5)]
    pairs = wanted(("c", "s50", "image"), ("c", "s2", "image"))
    ranks = {("c", "s50", "image"): INTERACTIVE, ("c", "s2", "image"): BULK}
    other_reader = CapacityCounts(lane={}, book_generating=running, waiting={"image": [Waiter(INTERACTIVE, [])]})
    handed_one = {"image": 1}  # one free slot for this claim (the lane's others are other refills')
    choice = choose(pairs, other_reader, specs, {}, handed_one, ranks)
    assert choice.chosen == []
    assert choice.refused == {Outcome.WINDOW_FULL: [("c", "s50", "image")], Outcome.LANE_FULL: [("c", "s2", "image")]}
    assert choice.waits_for == {"image"}
    one_free = replace(other_reader, lane={"image": 7})
    assert choose(pairs, one_free, specs, {}, ranks=ranks).refused[Outcome.LANE_FULL] == [("c", "s2", "image")]
    # With more slots free than readers waiting, the bulk scene takes one: one is kept for each reader.
    assert [pair for pair, _ in choose(pairs, other_reader, specs, {}, ranks=ranks).chosen] == [("c", "s2", "image")]
    # A reader already at its share could not use the slot, and a bulk book is less urgent: no share binds.
    at_its_share = Waiter(INTERACTIVE, [("o", f"s{i}", "image") for i in range(4)])
    for waiter in (at_its_share, Waiter(BULK, [])):
        chosen = [
            pair
            for pair, _ in choose(
                pairs, replace(other_reader, waiting={"image": [waiter]}), specs, {}, ranks=ranks
            ).chosen
        ]
        assert chosen == [("c", "s50", "image"), ("c", "s2", "image")]


def test_a_book_handed_a_slot_holds_it_from_less_urgent_pairs_and_binds_a_share_but_a_handed_one() -> None:
    """A book handed a slot is off the waiting list until its refill claims: a less urgent pass in between saw
    nobody waiting and took the slot. As urgent, it binds the share of a claim as a waiting book does: the refill
    of another book handed a slot moments before claimed both free slots past its share, and the handed book ran
    nothing for a job. Not of a claim of slots of its own (`room`: a hand-over to several books shares the slots out
    itself)."""
    limits = spec(AUDIO, lane_limit=8, book_quota=1, window=10)
    pairs = wanted(("c", "s1", "audio"), ("c", "s2", "audio"))
    reader = CapacityCounts(lane={"audio": 7}, book_generating=[], waiting={"audio": [Waiter(INTERACTIVE, [], True)]})
    bulk = dict.fromkeys((p for p, _ in pairs), BULK)
    assert choose(pairs, reader, limits, {}, ranks=bulk).refused == {Outcome.LANE_FULL: [p for p, _ in pairs]}
    fellow = replace(reader, lane={"audio": 0}, waiting={"audio": [Waiter(BULK, [], True)]})
    bound = choose(pairs, fellow, limits, {}, ranks=bulk)
    assert [pair for pair, _ in bound.chosen] == [pairs[0][0]]
    assert bound.refused == {Outcome.QUOTA_EXHAUSTED: [pairs[1][0]]}
    shared_out = choose(pairs, fellow, limits, {}, room={"audio": 2}, ranks=bulk)
    assert [pair for pair, _ in shared_out.chosen] == [p for p, _ in pairs]


def test_a_claim_of_its_own_slot_is_not_held_back_for_a_book_handed_another() -> None:
    """A refill fills the slot it was handed (`room`); a more urgent book handed another slot has that one, among
    the lane's others. Counted against the room as well, the refill was refused, passed its slot on, and the next
    less urgent waiter was refused the same way until the handed book's refill reported back."""
    limits = spec(AUDIO, lane_limit=4, book_quota=4, window=10)
    pairs = wanted(("c", "s1", "audio"))
    counts = CapacityCounts(lane={"audio": 2}, book_generating=[], waiting={"audio": [Waiter(INTERACTIVE, [], True)]})
    ranks = {("c", "s1", "audio"): BULK}
    assert [pair for pair, _ in choose(pairs, counts, limits, {}, {"audio": 1}, ranks).chosen] == [("c", "s1", "audio")]
    listed = replace(counts, waiting={"audio": [Waiter(INTERACTIVE, [])]})  # on the list: its slot is this one
    assert choose(pairs, listed, limits, {}, {"audio": 1}, ranks).refused == {Outcome.LANE_FULL: [("c", "s1", "audio")]}


def test_a_more_urgent_book_at_its_share_holds_a_slot_while_no_book_as_urgent_contests_it() -> None:
    """Old code: only a waiter below its share held a slot. A reader's book running 4 bulk audio scenes (window 4)
    was at its share though nobody as urgent contested the lane, so its handed image slot went to a bulk book's pass
    and the reader's scene waited a whole bulk job. Its own claim would take the slot (its share binds only for a
    book as urgent below its own), so the slot is held for it, as for a book below its share."""
    specs = {**spec(AUDIO, lane_limit=4, window=4), **spec(IMAGE, lane_limit=2, window=4)}
    busy = [("r", f"s{i}", "audio") for i in range(1, 5)]
    pairs = wanted(("q", "s1", "image"))
    bulk = {("q", "s1", "image"): BULK}

    def taken(*waiters: Waiter, lane: int = 1, **limits: int) -> list[tuple[str, str, str]]:
        image = {**specs, **spec(specs["image"], **limits)} if limits else specs
        counts = CapacityCounts(lane={"image": lane}, book_generating=[], waiting={"image": list(waiters)})
        return [pair for pair, _ in choose(pairs, counts, image, {}, ranks=bulk).chosen]

    for handed in (True, False):  # handed the slot (its refill on its way) or on the list
        assert taken(Waiter(INTERACTIVE, busy, handed)) == []
        assert taken(Waiter(INTERACTIVE, [], handed)) == []  # below its share, as before
        # Another reader below its share binds the first one's share: one slot is kept, for that one.
        assert taken(Waiter(INTERACTIVE, busy, handed), Waiter(INTERACTIVE, [], handed=False), lane=0) == [pairs[0][0]]
        # A less urgent book below its share does not bind the reader's share: a slot is kept for each.
        assert taken(Waiter(INTERACTIVE, busy, handed), Waiter(NORMAL, [], handed=False), lane=0) == []
        # The hard cap refuses the reader's claim whoever waits: nothing is kept for it.
        capped = [("r", "s1", "image"), ("r", "s2", "image")]
        assert taken(Waiter(INTERACTIVE, capped, handed), book_cap=2) == [pairs[0][0]]
    # A book as urgent as the pair is no reason to keep the slot (the share decides between them).
    assert taken(Waiter(BULK, busy)) == [pairs[0][0]]


def test_a_slot_is_kept_for_a_book_as_urgent_that_waited_longer_but_not_from_the_one_it_was_handed_to() -> None:
    """A regenerate that came as a slot freed (its job's refill not yet claimed) took it from the book that had waited
    longest; the book handed a slot claims it before the books behind it on the list."""
    waits = {"audio": [Waiter(NORMAL, [], ahead=True)]}
    pair = wanted(("c", "s1", "audio"))
    counts = CapacityCounts(lane={"audio": 1}, book_generating=[], waiting=waits)
    assert choose(pair, counts, spec(AUDIO, lane_limit=2), {}).refused == {Outcome.LANE_FULL: [("c", "s1", "audio")]}
    behind = CapacityCounts(lane={"audio": 1}, book_generating=[], waiting={"audio": [Waiter(NORMAL, [])]})
    assert choose(pair, behind, spec(AUDIO, lane_limit=2), {}).chosen == [(("c", "s1", "audio"), "d0")]
    handed_its_slot = choose(pair, counts, spec(AUDIO, lane_limit=2), {}, room={"audio": 1})
    assert handed_its_slot.chosen == [(("c", "s1", "audio"), "d0")]
    two_free = CapacityCounts(lane={}, book_generating=[], waiting=waits)
    assert choose(pair, two_free, spec(AUDIO, lane_limit=2), {}).chosen == [(("c", "s1", "audio"), "d0")]


def test_the_books_before_one_on_a_lane_s_list_are_those_placed_earlier_at_their_priority() -> None:
    places = {"old": 100.0, "mine": 200.0, "later": 300.0, "served": SERVED_AFTER + 50.0}
    ranks = dict.fromkeys(places, NORMAL)
    assert waited_longer(places, ranks, "mine", now=400.0) == {"old"}
    assert waited_longer(places, ranks, "newcomer", now=400.0) == {"old", "mine", "later"}  # not one served moments ago
    assert waited_longer(places, ranks, "served", now=400.0) == {"old", "mine", "later"}
    assert waited_longer({"head": 0.0, "old": 100.0}, {"head": NORMAL, "old": NORMAL}, "head", now=400.0) == set()
    # Listed at bulk since before `later` came at normal: at normal it would join now, behind `later`.
    assert waited_longer(places, {**ranks, "mine": BULK}, "mine", now=400.0) == {"old", "later"}
