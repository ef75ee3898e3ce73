"""The refill: a freed slot costs the next few pairs of one book, not the whole book.

Real Postgres, Redis and broker. The asset store is wrapped only to count the rows each read
returns (`RowCounter`): the reads themselves are the real ones.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from typing import Any

from animastor_tasks.domain.vocabulary import DeferralBucket, Outcome
from animastor_tasks.flow import candidates, refill
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.flow.job import Job
from animastor_tasks.flow.page import PassReport
from animastor_tasks.ports import GateRows
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, fake_artifact, make_book, states, use_settings
from .test_elastic_share import finish_one, lane, run_control, running, waiting
from .test_generate import dispatched_jobs


class RowCounter:
    """The real asset store, counting the in-flight rows its gate reads return."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.rows, self.full_reads = inner, 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def gate_candidates(self, book: str, stages: Any, limit: int) -> GateRows | None:
        found: GateRows | None = self.inner.gate_candidates(book, stages, limit)
        self.rows += 0 if found is None else len(found.in_flight)
        return found

    def gate_rows_many(self, books: Any, limit: int | None = None) -> dict[str, GateRows | None] | None:
        self.full_reads += 1
        found: dict[str, GateRows | None] | None = self.inner.gate_rows_many(books, limit)
        self.rows += sum(len(rows.in_flight) for rows in (found or {}).values() if rows is not None)
        return found


def counting(rt: Wiring) -> RowCounter:
    counter = RowCounter(rt.ports.assets)
    rt.ports = replace(rt.ports, assets=counter)
    return counter


def test_a_freed_slot_reads_a_few_rows_of_a_big_book_and_goes_to_the_right_pair(rt) -> None:
    lane(rt, lane_limit=2, book_quota=1, window=1)
    rt.catalog.import_book(make_book("big", chapters=2, scenes=150))  # 300 pending pairs
    rt.catalog.import_book(make_book("small", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "big", ["audio"])  # alone: both slots, s1 and s2
    counter = counting(rt)
    finish_one(rt, "big")  # nobody else waits: the book's own next scene in reading order
    assert [p for p, s in states(rt, "big").items() if s == "generating"] == [
        ("ch1", "s2", "audio"),
        ("ch1", "s3", "audio"),
    ]
    regenerate_flow.regenerate(rt.ports, "small", ["audio"])  # waits for the lane
    finish_one(rt, "big")  # its slot goes to the book that waited
    assert running(rt, "small", "big") == {"small": 1, "big": 1}
    assert counter.full_reads == 1  # small's regenerate; the freed slots read only candidates
    assert counter.rows <= 2 + 2 * candidates.candidate_limit([2]), counter.rows


def test_a_refill_that_could_use_more_than_it_read_reads_again(rt) -> None:
    lane(rt, lane_limit=40, book_quota=40, window=40)
    rt.catalog.import_book(make_book("wide", chapters=1, scenes=60))
    regenerate_flow.regenerate(rt.ports, "wide", ["audio"])
    assert running(rt, "wide") == {"wide": 40}
    # Free every slot at once, as a takeover does: one refill fills them all, over several reads.
    with rt.db.transaction() as conn:
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'wide' AND state = 'generating'")
    report = refill.refill(rt.ports, "wide", "gpu.audio")
    assert len(report.dispatched) == 20 and running(rt, "wide") == {"wide": 20}


def test_a_candidate_the_gate_denies_asks_for_the_full_pass_which_releases_it(rt) -> None:
    lane(rt, lane_limit=1, book_quota=1, window=1)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    rt.redis.client.zrem(rt.redis.keys.due(), "b")
    with rt.db.transaction() as conn:  # the layer turned off behind the gate's back
        conn.execute("UPDATE books SET layer_config = '{\"audio_enabled\": false}' WHERE book_id = 'b'")
    report = refill.refill(rt.ports, "b", "gpu.audio")
    assert report.dispatched == [] and set(report.denied.values()) == {"layer_disabled"}
    assert rt.redis.client.zscore(rt.redis.keys.due(), "b") is not None  # the full pass is due now
    assert states(rt, "b")[("ch1", "s2", "audio")] == "pending"  # a refill releases nothing itself


def test_the_books_own_last_job_ends_and_the_book_leaves_the_indexes(rt) -> None:
    lane(rt, lane_limit=2, book_quota=2, window=2)
    rt.catalog.import_book(make_book("done", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "done", ["audio"])
    finish_one(rt, "done")
    finish_one(rt, "done")
    run_control(rt)
    assert set(states(rt, "done").values()) == {"ready"}
    assert "done" not in rt.ports.book_state.active_books()
    assert rt.redis.client.zscore(rt.redis.keys.due(), "done") is None
    assert "done" not in waiting(rt)


def test_the_slot_a_job_freed_on_a_wide_lane_costs_a_few_candidates_not_two_per_slot_of_the_lane(rt) -> None:
    lane(rt, lane_limit=64, book_quota=64, window=64)
    rt.catalog.import_book(make_book("wide", chapters=1, scenes=100))
    regenerate_flow.regenerate(rt.ports, "wide", ["audio"])
    assert running(rt, "wide") == {"wide": 64}
    counter = counting(rt)
    finish_one(rt, "wide")  # s1 ends; its slot goes to s65, the next in reading order
    assert running(rt, "wide") == {"wide": 64}
    assert states(rt, "wide")[("ch1", "s65", "audio")] == "generating"
    assert counter.full_reads == 0
    assert counter.rows == candidates.candidate_limit([1]) < candidates.candidate_limit([64]), counter.rows


def test_a_freed_slot_whose_first_candidates_all_wait_on_a_timer_looks_further(rt) -> None:
    lane(rt, lane_limit=64, book_quota=64, window=64)
    rt.catalog.import_book(make_book("wide", chapters=1, scenes=100))
    regenerate_flow.regenerate(rt.ports, "wide", ["audio"])
    held = [("ch1", f"s{n}", "audio") for n in range(65, 91)]  # more than a one-slot read takes
    rt.ports.deferrals.defer("wide", DeferralBucket.IDEMPOTENT, held, 600, time.time())
    finish_one(rt, "wide")
    assert running(rt, "wide") == {"wide": 64}
    assert states(rt, "wide")[("ch1", "s91", "audio")] == "generating"
    assert {states(rt, "wide")[pair] for pair in held} == {"pending"}


def test_a_freed_slot_that_looks_further_judges_each_pair_once(rt) -> None:
    """The wider read starts from the first candidate again: the pairs the short read judged already were
    judged and counted a second time (16 of the 26 deferred ones counted twice, the refill's report said 42)."""
    lane(rt, lane_limit=64, book_quota=64, window=64)
    rt.catalog.import_book(make_book("wide", chapters=1, scenes=100))
    regenerate_flow.regenerate(rt.ports, "wide", ["audio"])
    held = [("ch1", f"s{n}", "audio") for n in range(65, 91)]
    rt.ports.deferrals.defer("wide", DeferralBucket.IDEMPOTENT, held, 600, time.time())
    with rt.db.transaction() as conn:  # one job ended: its slot is free
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'wide' AND scene_id = 's1'")
    rt.redis.client.delete(rt.redis.keys.deferrals("wide", "capacity"))  # as `free_slot` does with nobody waiting
    report = PassReport("wide")
    read = candidates.dispatch_candidates(rt.ports, report, "wide", None, slots_of="gpu.audio")
    assert states(rt, "wide")[("ch1", "s91", "audio")] == "generating"
    assert read == 16 + 36  # the short read, then every pending pair
    assert report.outcomes[Outcome.DEFERRED] == len(held)
    assert len(report.authorized) == len(set(report.authorized)) == report.authorized_count == 36


def test_a_handed_slot_leaves_a_pair_that_also_waits_on_another_timer_waiting(rt) -> None:
    """A pair deferred for capacity and as done-or-running both: a handed slot lifted its capacity deferral by
    taking the pair out of every bucket, and the pair was dispatched before its other window ended."""
    lane(rt, lane_limit=64, book_quota=64, window=64)
    rt.catalog.import_book(make_book("wide", chapters=1, scenes=100))
    regenerate_flow.regenerate(rt.ports, "wide", ["audio"])  # 64 run; the rest wait for capacity
    held = [("ch1", f"s{n}", "audio") for n in range(65, 91)]
    rt.ports.deferrals.defer("wide", DeferralBucket.IDEMPOTENT, held, 600, time.time())
    with rt.db.transaction() as conn:  # one job ended: its slot is free, and handed to the book
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'wide' AND scene_id = 's1'")
    report = PassReport("wide")
    candidates.dispatch_candidates(rt.ports, report, "wide", "gpu.audio")
    assert {states(rt, "wide")[pair] for pair in held} == {"pending"}
    assert states(rt, "wide")[("ch1", "s91", "audio")] == "generating"


def two_lanes(rt: Wiring, **limits: Any) -> None:
    """Both stages with these limits and instant builtin jobs, a live consumer on each queue."""
    specs = tuple(
        replace(rt.settings.registry.get(stage), params={"steps": 1, "step_seconds": 0}, **limits)
        for stage in ("audio", "image")
    )
    use_settings(rt, replace(rt.settings, registry=replace(rt.settings.registry, stages=specs)))
    advertise(rt, "gpu.audio")
    advertise(rt, "gpu.image")


def images_then_audio(rt: Wiring) -> None:
    """One book, alone: "generate images", then "generate audio"; both lanes full of its jobs."""
    two_lanes(rt, lane_limit=2, book_quota=64, window=64)
    rt.catalog.import_book(make_book("two", chapters=1, scenes=40))
    regenerate_flow.regenerate(rt.ports, "two", ["image"])
    time.sleep(0.01)  # the audio command is the younger: every image pair comes first in slot order
    regenerate_flow.regenerate(rt.ports, "two", ["audio"])
    assert running_by_stage(rt, "two") == {"image": 2, "audio": 2}


def running_by_stage(rt: Wiring, book: str) -> dict[str, int]:
    return dict(Counter(pair[2] for pair, state in states(rt, book).items() if state == "generating"))


def running_audio_job(rt: Wiring, book: str) -> Job:
    return next(job for job in dispatched_jobs(rt, book) if job.stage == "audio")


def test_a_freed_slot_goes_to_its_own_lane_when_another_stage_of_the_book_comes_first(rt) -> None:
    """The refill of a book's own freed slot read its first pairs in slot order: all of them image pairs (the
    older command), refused `lane_full`, and the freed audio slot stayed idle while 38 audio pairs waited."""
    images_then_audio(rt)
    assert run_job(rt.ports, running_audio_job(rt, "two"), worker="test@local")["outcome"] == "ready"
    run_control(rt)
    assert running_by_stage(rt, "two") == {"image": 2, "audio": 2}


def test_a_slot_freed_by_a_failed_job_goes_to_its_own_lane_through_the_control_worker(rt) -> None:
    """The same, for a slot whose refill is sent to the control worker (a job that failed or gave its pair
    back): the message names the freed lane."""
    images_then_audio(rt)
    job = running_audio_job(rt, "two")
    left = rt.ports.jobs.fail_job(*job.owned, "refused", "gpu.audio")
    assert left is not None
    refill.free_slot(rt.ports, "two", "gpu.audio", job.dispatch_id, left=left, here=False)
    assert [kwargs for name, kwargs in run_control(rt) if name == "animastor.refill"] == [
        {"book_id": "two", "lane": None, "freed": "gpu.audio"}
    ]
    assert running_by_stage(rt, "two") == {"image": 2, "audio": 2}


def _drain(rt: Wiring) -> None:
    for _ in range(100):
        jobs = dispatched_jobs(rt, "b")
        if not jobs:
            refill.refill(rt.ports, "b")
            if not (jobs := dispatched_jobs(rt, "b")):
                return
        for job in jobs:
            assert run_job(rt.ports, job, worker="w")["outcome"] == "ready"
    raise AssertionError("never drained")


def test_a_refill_refused_by_the_breaker_keeps_its_book_due(rt) -> None:
    """Handed a slot of a half-open lane whose test permit another pass had taken, the book's refill was refused
    by the breaker, wrote no deferral and left the due index as it was: off the waiting list and not due, the
    book waited for reconcile's round while the breaker closed."""
    lane(rt, lane_limit=2, book_quota=2, window=4)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    now = rt.redis.server_time()
    rt.redis.client.hset(
        rt.redis.keys.breaker("gpu.audio"),
        mapping={"failures": 5, "open_until": repr(now - 1), "permit_until": repr(now + 60)},  # permit out
    )
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    rt.redis.client.zrem(rt.redis.keys.due(), "b")  # the tick took it; then the book was handed the slot
    report = refill.refill(rt.ports, "b", "gpu.audio")
    assert report.outcomes[Outcome.BREAKER_OPEN] == 2
    assert rt.redis.client.zscore(rt.redis.keys.due(), "b") is not None


def test_a_pair_whose_inputs_were_never_hashed_runs_rather_than_waiting_for_ever(rt) -> None:
    """A ready pair with no input hash on record (a stage its scene's import did not know) read as done already
    (None == None) but Postgres settled nothing (NULL = NULL is not true): it was neither claimed nor deferred,
    its command stayed active and its book was passed on every tick."""
    lane(rt, lane_limit=2, book_quota=2, window=4)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    _drain(rt)
    with rt.db.transaction() as conn:
        conn.execute("UPDATE asset_states SET input_hash = NULL WHERE book_id = 'b'")
        conn.execute("UPDATE scenes SET input_hashes = '{}'::jsonb WHERE book_id = 'b'")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=False)
    assert states(rt, "b") == {("ch1", "s1", "audio"): "generating"}


def test_a_broker_refusing_a_hand_over_costs_the_pass_that_claimed_nothing(rt, monkeypatch) -> None:
    """The pass had claimed and published; handing its spare slots to a waiting book, kombu's error for the
    refill it could not send went past every caller: a regenerate failed after its work was done, and a tick's
    batch of passes ended there, the books after it left to reconcile."""
    from kombu.exceptions import OperationalError

    lane(rt, lane_limit=4, book_quota=4, window=4)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    rt.ports.deferrals.wait_for_lane("gpu.audio", "x", 100.0)  # another book waits for the lane
    app = rt.ports.publisher.app
    send = app.send_task

    def broker_down(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "animastor.refill":
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return send(name, *args, **kwargs)

    monkeypatch.setattr(app, "send_task", broker_down)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert states(rt, "b") == {("ch1", "s1", "audio"): "generating"}


def test_a_slot_freed_as_nobody_waited_goes_to_a_book_that_came_back_to_the_list_meanwhile(rt, monkeypatch) -> None:
    """A book's own job ended while no book was on the lane's waiting list (the one waiting was off it, its refill
    on its way), so its refill was its own; it had nothing left for the lane, and the slot was dropped, while the
    other book, back on the list by then, waited for the tick to find the lane stranded (two ticks)."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    rt.catalog.import_book(make_book("c", chapters=1, scenes=2))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    regenerate_flow.regenerate(rt.ports, "c", ["audio"])
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert running(rt, "c", "b") == Counter({"c": 2}) and "b" in waiting(rt)
    score = waiting(rt)["b"]
    rt.redis.client.zrem(rt.redis.keys.lane_waiters("gpu.audio"), "b")  # handed another slot: its refill on its way
    real = candidates.dispatch_candidates

    def back_on_the_list(*args: Any, **kwargs: Any) -> Any:
        rt.ports.deferrals.wait_for_lane("gpu.audio", "b", score)  # its refill found the lane full again
        return real(*args, **kwargs)

    monkeypatch.setattr(candidates, "dispatch_candidates", back_on_the_list)
    finish_one(rt, "c")
    monkeypatch.undo()
    assert running(rt, "c", "b") == Counter({"c": 1, "b": 1})


def _already_current(rt: Wiring, book: str, scenes: range) -> None:
    """These pending pairs' media is current, as a regenerate that was not forced leaves an unchanged scene's."""
    with rt.db.transaction() as conn:
        conn.execute(
            "UPDATE asset_states a SET input_hash = s.input_hashes->>a.stage, artifact_sha256 = repeat('0', 64)"
            " FROM scenes s WHERE (s.book_id, s.chapter_id, s.scene_id) = (a.book_id, a.chapter_id, a.scene_id)"
            " AND a.book_id = %s AND a.state = 'pending' AND a.scene_id = ANY(%s)",
            (book, [f"s{n}" for n in scenes]),
        )
    rt.redis.client.delete(rt.redis.keys.force_set(book))


def test_a_freed_slot_whose_first_candidates_are_all_done_already_looks_further(rt) -> None:
    """A read's candidates all settled as already completed were taken for a lane with no room: the slot idled with
    work pending, the book on no waiting list and not due (soak hunt: 2-8 s, up to the reconcile period)."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=60))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # s1 and s2 run
    _already_current(rt, "b", range(3, 43))  # more than two reads of a one-slot refill
    finish_one(rt, "b")
    assert running(rt, "b") == {"b": 2}
    assert states(rt, "b")[("ch1", "s43", "audio")] == "generating"
    assert {states(rt, "b")[("ch1", f"s{n}", "audio")] for n in range(3, 43)} == {"ready"}


def test_a_freed_slot_that_looks_past_pairs_done_already_still_claims_only_its_own_slot(rt) -> None:
    """The lane's other free slots are those of jobs ending elsewhere, each refilled by its own process."""
    lane(rt, lane_limit=4, book_quota=4, window=4)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=60))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # s1 to s4 run
    _already_current(rt, "b", range(6, 21))  # s5 then 15 done: the one-slot read's 16
    with rt.db.transaction() as conn:  # two jobs ended elsewhere, their refills on their way
        conn.execute("UPDATE asset_states SET state = 'ready' WHERE book_id = 'b' AND scene_id IN ('s3', 's4')")
    finish_one(rt, "b")
    assert [p[1] for p, s in states(rt, "b").items() if s == "generating"] == ["s2", "s5"]


def test_a_freed_slot_past_more_pairs_done_already_than_a_refill_reads_gets_the_books_pass_at_once(rt) -> None:
    """Its rounds ran out (8 reads of 16, all done already) with the lanes free: the book waited for the tick's pass,
    every slot idle meanwhile (non-forced regenerate hunt: 3.5 s of a big book's first pass, up to a tick)."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=320))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # s1 and s2 run
    _already_current(rt, "b", range(3, 301))  # more than a refill reads: 8 reads of 16, twice
    finish_one(rt, "b")  # its refill, then the control work it sent
    assert running(rt, "b") == {"b": 2}
    assert states(rt, "b")[("ch1", "s301", "audio")] == "generating"


class _ThenAnotherRefill:
    """The real asset store; the first candidate read it answers is followed by another process's whole refill, before
    the reader goes on to its claim (two jobs of the lane ending milliseconds apart)."""

    def __init__(self, inner: Any, other: Any) -> None:
        self.inner, self.other = inner, other

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def gate_candidates(self, book: str, stages: Any, limit: int) -> GateRows | None:
        found: GateRows | None = self.inner.gate_candidates(book, stages, limit)
        other, self.other = self.other, None
        if other is not None:
            other()
        return found


def test_a_freed_slot_whose_one_pair_of_its_lane_another_refill_took_meanwhile_reads_its_lane_on(rt) -> None:
    """Its read held 15 image pairs (the older command, their lane full) and one audio pair, which the other job's
    refill claimed meanwhile: the claim counted the audio lane as claimed though no audio pair was left in it, the
    refill read no further, and the audio slot idled with audio work pending (non-forced regenerate hunt, 1.8 s)."""
    two_lanes(rt, lane_limit=2, book_quota=64, window=64)
    rt.catalog.import_book(make_book("two", chapters=1, scenes=40))
    regenerate_flow.regenerate(rt.ports, "two", ["image"], [["ch1", f"s{n}"] for n in range(1, 18)])  # 15 wait
    time.sleep(0.01)  # the audio command is the younger: those image pairs come first in slot order
    regenerate_flow.regenerate(rt.ports, "two", ["audio"])
    first, second = [job for job in dispatched_jobs(rt, "two") if job.stage == "audio"]
    left = [rt.ports.jobs.commit_job(*job.owned, fake_artifact("two"), "gpu.audio") for job in (first, second)]
    assert None not in left

    def first_ends() -> None:
        refill.free_slot(rt.ports, "two", "gpu.audio", first.dispatch_id, left=left[0], here=True)  # type: ignore[arg-type]

    rt.ports = replace(rt.ports, assets=_ThenAnotherRefill(rt.ports.assets, first_ends))
    refill.free_slot(rt.ports, "two", "gpu.audio", second.dispatch_id, left=left[1], here=True)  # type: ignore[arg-type]
    run_control(rt)
    assert running_by_stage(rt, "two") == {"image": 2, "audio": 2}


def test_refills_whose_reads_run_out_together_send_one_pass_of_their_book(rt) -> None:
    """Each sent its own (review: 7 passes of one 12,000-scene book queued by 30 job ends on a lane of 64)."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=720))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # s1 and s2 run
    _already_current(rt, "b", range(3, 701))  # more than two refills read
    for job in dispatched_jobs(rt, "b"):
        left = rt.ports.jobs.commit_job(*job.owned, fake_artifact("b"), "gpu.audio")
        refill.free_slot(rt.ports, "b", "gpu.audio", job.dispatch_id, left=left, here=True)  # type: ignore[arg-type]
    sent = run_control(rt)
    assert [name for name, _ in sent].count("animastor.gate_batch") == 1, sent
    assert running(rt, "b") == {"b": 2}


def test_a_handed_slot_whose_pair_a_concurrent_pass_took_is_handed_on_once(rt, monkeypatch) -> None:
    """Its claim hands the lane's spare slot on itself; a refill that also passed the slot on handed one free slot to
    two books (review of 6281de4: x and y both sent a refill, y bounced back to the head of its priority)."""
    lane(rt, lane_limit=3, book_quota=64, window=64)
    for book, scenes in (("a", 3), ("w", 1), ("x", 2), ("y", 2)):
        rt.catalog.import_book(make_book(book, chapters=1, scenes=scenes))
    regenerate_flow.regenerate(rt.ports, "a", ["audio"])  # the lane full of a's jobs
    for book in ("w", "x", "y"):
        time.sleep(0.01)
        regenerate_flow.regenerate(rt.ports, book, ["audio"])  # each waits for the lane
    run_control(rt)
    for job in dispatched_jobs(rt, "a")[:2]:  # two slots free
        rt.ports.jobs.commit_job(*job.owned, fake_artifact("a"), "gpu.audio")
    sent: list[str] = []
    enqueue = rt.ports.publisher.enqueue_refill

    def recorded(book: str, *args: Any, **kwargs: Any) -> None:
        sent.append(book)
        enqueue(book, *args, **kwargs)

    monkeypatch.setattr(rt.ports.publisher, "enqueue_refill", recorded)

    def w_claims_meanwhile() -> None:  # another pass of w claims its one pair after this refill's read
        refill.refill(rt.ports, "w", "gpu.audio")

    rt.ports = replace(rt.ports, assets=_ThenAnotherRefill(rt.ports.assets, w_claims_meanwhile))
    refill.refill(rt.ports, "w", "gpu.audio")
    assert running(rt, "w") == {"w": 1}
    assert sent == ["x"], sent  # the one slot left, to the book that waited longest, once


def test_a_books_first_pass_by_candidates_reads_each_lane_its_first_read_left_out(rt) -> None:
    """A regenerate's first pass of a big book (a refill of no lane): its read held only image pairs (the older
    command, their lane full), and the audio lane idled until the tick's pass (soak re-test: 4 gaps, up to 4.3 s)."""
    images_then_audio(rt)
    for job in [job for job in dispatched_jobs(rt, "two") if job.stage == "audio"]:  # the audio lane empties
        assert rt.ports.jobs.commit_job(*job.owned, fake_artifact("two"), "gpu.audio") is not None
    rt.redis.client.delete(rt.redis.keys.deferrals("two", "capacity"))  # as its jobs' ends do, nobody else waiting
    refill.refill(rt.ports, "two")
    assert running_by_stage(rt, "two") == {"image": 2, "audio": 2}


class _ThenSettled:
    """The real asset store; after the first candidate read it answers, the first pair read is settled `ready` (a
    concurrent pass found it done already), before the reader goes on to its claim."""

    def __init__(self, inner: Any, rt: Wiring) -> None:
        self.inner, self.rt, self.armed = inner, rt, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def gate_candidates(self, book: str, stages: Any, limit: int) -> GateRows | None:
        found: GateRows | None = self.inner.gate_candidates(book, stages, limit)
        if self.armed and found is not None and found.in_flight:
            self.armed = False
            chapter, scene, stage = found.in_flight[0].pair
            with self.rt.db.transaction() as conn:
                conn.execute(
                    "UPDATE asset_states SET state = 'ready' WHERE book_id = %s AND chapter_id = %s AND scene_id = %s"
                    " AND stage = %s",
                    (book, chapter, scene, stage),
                )
        return found


def test_a_freed_slot_whose_first_candidate_was_settled_meanwhile_goes_to_the_next(rt) -> None:
    """The settled pair still took the claim's one slot and failed its compare-and-set: nothing was claimed, the rest
    refused `lane_full`, and the slot idled (soak re-test: 4.4 s, an interactive regenerate of a scene done already)."""
    lane(rt, lane_limit=2, book_quota=2, window=2)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=10))
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])  # s1 and s2 run
    job = dispatched_jobs(rt, "b")[0]
    left = rt.ports.jobs.commit_job(*job.owned, fake_artifact("b"), "gpu.audio")
    rt.ports = replace(rt.ports, assets=_ThenSettled(rt.ports.assets, rt))
    refill.free_slot(rt.ports, "b", "gpu.audio", job.dispatch_id, left=left, here=True)  # type: ignore[arg-type]
    assert states(rt, "b")[("ch1", "s3", "audio")] == "ready"
    assert states(rt, "b")[("ch1", "s4", "audio")] == "generating"
    assert running(rt, "b") == {"b": 2}
