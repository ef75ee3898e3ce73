"""Issue 7, item 6: the Stop All race, at least 100 trials (500 at long scale) in one long-lived cluster.

Each trial regenerates the same book (all stages, forced) through the public client and cancels it at a
random moment 0-300 ms after the regenerate returned: before its jobs start, while they start, while they
run, between one batch and the next. Pass criterion, from the journal: no `job.started` of a dispatch issued
before a cancel has `at` after that cancel returned (Postgres time read right after `cancel` returned), and
no `job.ready` either. The next trial's regenerate is a new explicit intent, so the window of each trial
ends when the next one begins; the last one is watched for a while after its cancel.
"""

from __future__ import annotations

import bisect
import random
import time
from collections import Counter

import pytest

from tests.e2e.harness import audio_stage, image_stage, stage_table
from tests.integration.helpers import make_book

from .checks import unauthorized_dispatches
from .scale import current as current_scale

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.timeout(current_scale().pick(300, 900))]

JOB = {"steps": 4, "step_seconds": 0.05}  # 0.2 s per job: a 0-300 ms delay lands anywhere in a batch


def test_cancel_at_a_random_moment_after_regenerate_starts_no_job(make_stack, figure, scale) -> None:
    trials = scale.pick(100, 500)
    rng = random.Random(7_000 + trials)
    stack = make_stack(
        stages=stage_table(audio=audio_stage(params=JOB, lease_ttl=3), image=image_stage(params=JOB, lease_ttl=3))
    )
    cluster = stack.cluster
    procs = [cluster.control(wait=False), cluster.gpu("audio", wait=False), cluster.gpu("image", wait=False)]
    cluster.wait_ready(*procs, cluster.beat(wait=False))
    book = make_book("stop-all-race", chapters=2, scenes=3)
    stack.rt.catalog.import_book(book)
    client = stack.client

    began_at: list = []  # Postgres time just before each trial's regenerate was sent
    cancelled_at: list = []  # Postgres time just after each trial's cancel returned
    delays: list[float] = []
    left_in_flight: list[int] = []
    began = time.monotonic()
    for _ in range(trials):
        began_at.append(stack.db_now())
        client.regenerate(book.book_id, ["all"])
        delay = rng.uniform(0.0, 0.3)
        time.sleep(delay)
        client.cancel(book.book_id, reason="race")
        cancelled_at.append(stack.db_now())
        delays.append(delay)
        states = stack.states(book.book_id).values()
        left_in_flight.append(sum(1 for s in states if s in ("pending", "generating")))
    time.sleep(2.0)  # queued jobs of the last trials are delivered (and must be refused) meanwhile
    watched_until = stack.db_now()
    elapsed = time.monotonic() - began

    def trial_of(at) -> int:
        return bisect.bisect_right(began_at, at) - 1

    dispatched = {e["dispatch_id"]: trial_of(e["at"]) for e in stack.events("dispatch", book.book_id)}
    started = stack.events("job.started", book.book_id)
    ready = stack.events("job.ready", book.book_id)
    late_starts, late_ready = [], []
    for kind, events, late in (("started", started, late_starts), ("ready", ready, late_ready)):
        for e in events:
            trial = dispatched[e["dispatch_id"]]
            assert began_at[trial] <= e["at"], (kind, e)
            if e["at"] > cancelled_at[trial]:
                late.append((trial, kind, e["dispatch_id"], (e["at"] - cancelled_at[trial]).total_seconds()))
    start_of = {e["dispatch_id"]: e["at"] for e in started}
    # Claims whose transaction began after the cancel's but took the pairs' row locks first: they commit
    # first, then the cancel releases the pairs and revokes the jobs (the journal check orders them by id).
    cancel_began = [e["at"] for e in stack.events("book.cancelled", book.book_id)]
    assert len(cancel_began) == trials
    raced = sum(1 for e in stack.events("dispatch", book.book_id) if e["at"] > cancel_began[trial_of(e["at"])])
    ready_of_late_start = [e for e in ready if start_of[e["dispatch_id"]] > cancelled_at[dispatched[e["dispatch_id"]]]]

    # Sanity: the race was really run (jobs dispatched, started and running when cancels came) ...
    per_trial_started = Counter(dispatched[e["dispatch_id"]] for e in started)
    per_trial_ready = Counter(dispatched[e["dispatch_id"]] for e in ready)
    trials_with_start = sum(1 for t in range(trials) if per_trial_started[t])
    cut_mid_run = sum(1 for t in range(trials) if per_trial_started[t] > per_trial_ready[t])
    assert len(dispatched) >= trials and trials_with_start >= trials // 4, (len(dispatched), trials_with_start)
    # ... and every cancel left nothing queued behind it.
    assert left_in_flight == [0] * trials, [i for i, n in enumerate(left_in_flight) if n]
    assert late_starts == [], f"{len(late_starts)} job start(s) after cancel returned: {late_starts[:5]}"
    assert late_ready == [] and ready_of_late_start == [], (late_ready[:5], ready_of_late_start[:5])
    assert all(e["at"] <= watched_until for e in started)
    assert {r.status for r in stack.commands(book.book_id).values()} == {"cancelled"}
    assert unauthorized_dispatches(stack) == []
    outcomes: Counter[str] = Counter()
    for proc in procs[1:]:
        for line in proc.log().splitlines():
            if "Discarding revoked task" in line:
                outcomes["revoked"] += 1
            elif "[GENERATE]" in line and " fence_rejected: " in line:
                outcomes[
                    "fence_rejected: " + line.split(" fence_rejected: ", 1)[1].split(" command_id=")[0].strip()
                ] += 1
            elif "[GENERATE]" in line and " stopping: " in line:
                outcomes["stopped: " + line.split(" stopping: ", 1)[1].split(" command_id=")[0].strip()] += 1
    figure(
        f"trials {trials} in {elapsed:.1f}s, cancel {min(delays) * 1000:.0f}-{max(delays) * 1000:.0f} ms after "
        f"regenerate returned; dispatches {len(dispatched)}, jobs started {len(started)} (in {trials_with_start} "
        f"trials), trials with a job running at the cancel {cut_mid_run}, claims that raced the cancel's "
        f"transaction {raced}, ready {len(ready)}; outcomes of the "
        f"rest {dict(sorted(outcomes.items()))}; job starts after cancel returned 0, job.ready of a dispatch "
        f"after its cancel 0 (lost/duplicated: n/a, every command cancelled)"
    )
