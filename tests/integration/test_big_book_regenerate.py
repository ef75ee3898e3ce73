"""A regenerate of a few scenes in a big book costs what those scenes do, not what the book holds.

Its pass over every pair in flight (and Redis's sets of the book, read with its own writes) cost a reader's
one scene half a second of the control worker in a book of 50,000 pending pairs. In a book of more than
`BIG_BOOK_SCENES` active scenes it dispatches from the book's next pairs in slot order, as a refill does,
and leaves the full pass to the tick at once. Real Postgres, Redis and broker.
"""

from __future__ import annotations

import time

from animastor_tasks.flow import gate
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.regenerate import BIG_BOOK_SCENES
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book, read_calls, states
from .test_elastic_share import lane

SCENES = BIG_BOOK_SCENES + 20


def _pair(n: int) -> tuple[str, str, str]:
    return ("ch1", f"s{n}", "audio")


def test_start_work_reads_the_snapshot_of_a_book_up_to_its_most_scenes_and_nothing_of_a_bigger_one(
    rt: Wiring,
) -> None:
    lane(rt, lane_limit=2)
    rt.catalog.import_book(make_book("one", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "one", ["audio"])  # a waiting list, a deferral, a due entry to read
    state = rt.ports.book_state
    pairs = [_pair(n) for n in range(1, 5)]
    now, queues = time.time(), rt.settings.registry.queues()
    for book in ("two", "three"):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=4))
    read = state.start_work("two", pairs, [p[:2] for p in pairs], force_ttl=60, snapshot=(now, queues), most_scenes=4)
    assert read is not None and read == state.book_snapshots(["two"], now, queues)["two"]
    assert read.force == set(pairs) and read.active == {p[:2] for p in pairs}
    assert read.waiters == {"gpu.audio": {"one": 1}} and read.consumers == {"gpu.audio": 1}
    one = state.start_work("one", pairs[:1], [pairs[0][:2]], force_ttl=60, snapshot=(now, queues), most_scenes=4)
    full = state.book_snapshots(["one"], now, queues)["one"]
    assert one == full and one.deferred == full.deferred and one.first_deferral_end == full.first_deferral_end
    assert any(one.deferred.values()) and one.first_deferral_end is not None  # deferrals with their ends, read
    bigger = state.start_work(
        "three", pairs, [p[:2] for p in pairs], force_ttl=60, snapshot=(now, queues), most_scenes=3
    )
    assert bigger is None
    assert state.book_snapshots(["three"], now, queues)["three"].force == set(pairs)  # its writes were made


def test_a_one_scene_regenerate_in_a_big_book_dispatches_it_without_passing_the_book(rt: Wiring) -> None:
    lane(rt, lane_limit=4)
    rt.catalog.import_book(make_book("big", chapters=1, scenes=SCENES))
    regenerate_flow.regenerate(rt.ports, "big", ["audio"], priority="bulk")  # every scene, four of them running
    assert list(states(rt, "big").values()).count("generating") == 4
    # The whole-book regenerate asked for a full pass.
    assert rt.ports.book_state.take_due(rt.ports.clock()).due == ["big"]
    gate.gate_pass(rt.ports, "big")  # the tick's: every waiting pair deferred, the book due at the first end
    with rt.db.transaction() as conn:  # two slots free again, as two jobs ending would leave them
        conn.execute(
            "UPDATE asset_states SET state = 'ready' WHERE book_id = 'big' AND state = 'generating'"
            " AND scene_id IN ('s1', 's2')"
        )
    passed = read_calls(rt, "gate_rows_many", "gate_row_pages")
    asked = time.time()
    regenerate_flow.regenerate(rt.ports, "big", ["audio"], [["ch1", f"s{SCENES}"]], priority="interactive")
    assert passed == []  # not one read of the book's pairs in flight
    after = states(rt, "big")
    assert after[_pair(SCENES)] == "generating"  # the reader's scene took a free slot at once
    due = rt.redis.client.zscore(rt.redis.keys.due(), "big")
    assert due is not None and float(due) > time.time() + 30  # judged: no full pass needed before a slot frees
    behind = f"s{SCENES - 1}"  # bulk, after the whole-book command: behind its backlog, not among the candidates
    regenerate_flow.regenerate(rt.ports, "big", ["audio"], [["ch1", behind]], priority="bulk")
    assert passed == []
    due = rt.redis.client.zscore(rt.redis.keys.due(), "big")
    # The tick passes the book whole at once: due now, on the runtime's clock (a second either way of this host's).
    assert due is not None and asked - 1 <= float(due) <= time.time() + 1
