"""Issue 7, item 4: Postgres unavailable for a while during a run (8 s at CI scale, 20 s at long scale).

The cluster runs against a private embedded PostgreSQL 18 (`devstack.LocalStores`), stopped with a fast
shutdown and started again with its data. While it is down nothing may be dispatched (no `dispatch` event
inside the outage, and no publish on a GPU queue, seen through the broker's keyspace notifications); a
`regenerate` sent during the outage either fails with a clear error naming Postgres, or is carried out after
the recovery, never silently dropped; when Postgres is back the work resumes and every pair becomes ready.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from animastor_tasks.adapters.postgres.migrations import migrate
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.client import Client
from animastor_tasks.dev.local_stores import LocalStores
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from tests.e2e.harness import RedisQueueTap, audio_stage, image_stage, stage_table, wait_for
from tests.integration.helpers import advertise, make_book
from tests.integration.test_generate import dispatched_jobs

from .checks import check_runs, unauthorized_dispatches

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

JOB = {"steps": 4, "step_seconds": 0.15}  # 0.6 s per job


@pytest.fixture
def private_postgres(tmp_path: Path) -> Iterator[tuple[LocalStores, str]]:
    """An embedded PostgreSQL of the test's own (requested before `make_stack`, so it outlives the cluster)."""
    stores = LocalStores(tmp_path / "pg-store")
    try:
        url = stores.start(redis=False, database="animastor_faults")["ANIMASTOR_DATABASE_URL"]
        db = Database(url, max_size=1)
        migrate(db)
        db.close()
        yield stores, url
    finally:
        stores.stop()


def _usable(db: Database) -> bool:
    try:
        db.ping()
    except StoreUnavailable:
        return False
    return True


def _wall(seconds: float) -> datetime:
    """A wall-clock instant as Postgres writes `now()` (same machine, same clock)."""
    return datetime.fromtimestamp(seconds, tz=UTC)


def test_postgres_outage_during_a_run(private_postgres, make_stack, figure, scale) -> None:
    outage = scale.pick(8.0, 20.0)
    postgres, url = private_postgres
    stack = make_stack(
        stages=stage_table(audio=audio_stage(params=JOB, lease_ttl=3), image=image_stage(params=JOB, lease_ttl=3)),
        database_url=url,
    )
    assert stack.settings.database_url == url
    cluster = stack.cluster
    procs = [cluster.control(wait=False), cluster.gpu("audio", wait=False), cluster.gpu("image", wait=False)]
    cluster.wait_ready(*procs, cluster.beat(wait=False))
    book = make_book("pg-outage", chapters=4, scenes=4)
    late = make_book("sent-during-outage", chapters=1, scenes=2)
    for b in (book, late):
        stack.rt.catalog.import_book(b)
    pairs = set(stack.states(book.book_id))
    late_pairs = set(stack.states(late.book_id))

    tap = RedisQueueTap(stack.env["ANIMASTOR_BROKER_URL"], ["gpu.audio", "gpu.image"])
    try:
        stack.client.regenerate(book.book_id, ["all"])
        wait_for(lambda: len(stack.events("job.ready", book.book_id)) >= 4, 20, what="the run under way")
        in_flight = sum(1 for s in stack.states(book.book_id).values() if s in ("pending", "generating"))
        assert in_flight >= 8, f"only {in_flight} pairs left to run: the outage would hit an idle system"

        stopping = time.monotonic()
        postgres.stop_postgres()
        down, down_wall = time.monotonic(), time.time()

        # A regenerate sent while Postgres is down: a clear error naming Postgres, or carried out later.
        command_id = str(uuid.uuid4())
        client = Client(stack.settings, timeout=20)
        sent = time.monotonic()
        try:
            answer: dict | None = client.regenerate(late.book_id, ["audio"], command_id=command_id)
            error = ""
        except Exception as err:
            answer, error = None, f"{type(err).__name__}: {err}"
        finally:
            client.close()
        answered_in = time.monotonic() - sent
        if answer is None:
            # The task's own error, rebuilt for its caller (it arrived as a bare Exception with its text).
            assert error.startswith("StoreUnavailable: postgres unavailable"), f"unclear error: {error}"

        time.sleep(max(0.0, outage - (time.monotonic() - down)))
        restarting, restarting_wall = time.monotonic(), time.time()
        assert postgres.start(redis=False, database="animastor_faults")["ANIMASTOR_DATABASE_URL"] == url
        up = time.monotonic()
        time.sleep(0.3)  # let the tap drain its notifications for the outage window
        during = [q for t, q in tap.push_times if down < t < restarting]
        while_stopping = [q for t, q in tap.push_times if stopping <= t <= down]
    finally:
        tap.close()

    # The observer's own pooled connections died with the server: drain them (one failed checkout each).
    wait_for(lambda: _usable(stack.rt.db), 10, what="the observer reconnected to Postgres")
    rows = stack.wait_commands(book.book_id, ["audio", "image"], "completed", timeout=90)
    recovered = time.monotonic() - up
    assert rows["audio"].progress["ready"] == rows["image"].progress["ready"] == len(pairs) // 2
    assert set(stack.states(book.book_id).values()) == {"ready"}
    check_runs(stack, book.book_id, pairs, 1)  # nothing lost, nothing committed twice
    assert during == [], f"{len(during)} GPU publish(es) while Postgres was down: {during}"
    dispatched_inside = [e for e in stack.events("dispatch") if _wall(down_wall) < e["at"] < _wall(restarting_wall)]
    assert dispatched_inside == [], dispatched_inside
    assert unauthorized_dispatches(stack) == []
    after = [e["at"] for e in stack.events("dispatch", book.book_id) if e["at"] > _wall(restarting_wall)]
    assert after, "nothing was dispatched after Postgres came back: the work did not resume through a dispatch"
    first_dispatch = (min(after) - _wall(restarting_wall)).total_seconds()

    # The regenerate sent during the outage was either refused (nothing written) or carried out after it.
    late_rows = stack.rt.ports.commands.commands(book=late.book_id)
    if answer is None:
        assert late_rows == [], f"a refused regenerate wrote commands: {late_rows}"
        assert set(stack.states(late.book_id).values()) <= {"dirty"}
        verdict = f"refused in {answered_in:.2f}s with {error[:90]!r}"
    else:
        assert [c["command_id"] for c in answer["commands"]] == [command_id]
        stack.wait_commands(late.book_id, ["audio"], "completed", timeout=30)
        assert {p for p, s in stack.states(late.book_id).items() if s == "ready"} == {
            p for p in late_pairs if p[2] == "audio"
        }
        verdict = f"accepted after {answered_in:.2f}s and completed after the recovery"
    figure(
        f"outage {restarting - down:.1f}s (stop took {down - stopping:.2f}s) with {in_flight} pairs in flight: "
        f"GPU publishes during the outage 0 ({len(while_stopping)} while stopping, before it was down), "
        f"dispatch events inside it 0; regenerate during the outage {verdict}; after Postgres came back "
        f"(start {up - restarting:.2f}s): first dispatch {first_dispatch:.2f}s, all {len(pairs)} pairs ready "
        f"{recovered:.2f}s; lost 0, duplicated 0, unauthorized dispatches 0, leases expired "
        f"{len(stack.events('lease.expired', book.book_id))}"
    )


@pytest.mark.parametrize(("lease_ttl", "outage"), [(30, 4.0), (2, 9.0)])
def test_a_job_that_ends_while_postgres_is_down_commits_once_it_is_back(
    private_postgres, make_stack, figure, lease_ttl: int, outage: float
) -> None:
    """The GPU work of a job whose commit meets the outage is kept: the commit waits for Postgres (the job still
    holds its lease) instead of the scene running again from the start with its start counted as lost. An outage
    longer than the lease TTL (2 s here): the commit gave up after one TTL although its watcher kept the lease,
    and the job's work was done again once Postgres was back; it now waits within its share of the time limit."""
    postgres, url = private_postgres
    slow = {"steps": 10, "step_seconds": 0.2}  # 2 s of generation: Postgres goes down meanwhile
    stack = make_stack(
        stages=stage_table(audio=audio_stage(params=slow, lease_ttl=lease_ttl), image=image_stage()),
        database_url=url,
    )
    rt = stack.rt
    book = make_book("commit-outage", chapters=1, scenes=1)
    rt.catalog.import_book(book)
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, book.book_id, ["audio"])
    [job] = dispatched_jobs(rt, book.book_id)

    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(run_job(rt.ports, job, worker="commit-test#1")))
    runner.start()
    wait_for(lambda: stack.events("job.started", book.book_id), 10, what="the job started")
    postgres.stop_postgres()
    down = time.monotonic()
    time.sleep(outage)  # the generation ends inside the outage: its commit fails until Postgres is back
    assert runner.is_alive(), f"the job ended while Postgres was down: {outcome}"
    assert postgres.start(redis=False, database="animastor_faults")["ANIMASTOR_DATABASE_URL"] == url
    up = time.monotonic()
    runner.join(timeout=30)
    committed = time.monotonic() - up

    assert outcome.get("outcome") == "ready", outcome
    assert stack.states(book.book_id) == {("ch1", "s1", "audio"): "ready", ("ch1", "s1", "image"): "dirty"}
    assert len(stack.events("job.started", book.book_id)) == 1  # ran once: no second start, none counted lost
    assert stack.query("SELECT count(*) FROM artifacts WHERE book_id = %s", (book.book_id,)) == [(1,)]
    [(open_start,)] = stack.query("SELECT open_dispatch FROM job_starts WHERE book_id = %s", (book.book_id,))
    assert open_start is None
    figure(f"commit met a {up - down:.1f}s Postgres outage: committed {committed:.2f}s after it came back, ran once")


def test_a_commit_waiting_out_an_outage_is_not_cut_by_the_soft_time_limit(private_postgres, make_stack, figure) -> None:
    """On a real prefork GPU worker: the job's generation ends inside a Postgres outage and the soft time limit
    fires while its commit waits for Postgres. The limit is for a generator that runs too long; this one has
    finished. It fired inside the commit's wait: the task failed with Celery's exception, the GPU work was
    thrown away, and the pair ran again from the start once Postgres was back (its first start counted lost)."""
    postgres, url = private_postgres
    slow = {"steps": 6, "step_seconds": 0.25}  # 1.5 s of generation: Postgres goes down meanwhile
    stack = make_stack(
        stages=stage_table(audio=audio_stage(params=slow, lease_ttl=30), image=image_stage()),
        database_url=url,
        job_soft_time_limit=3,
        job_time_limit=30,
    )
    cluster = stack.cluster
    cluster.wait_ready(cluster.control(wait=False), cluster.gpu("audio", wait=False), cluster.beat(wait=False))
    book = make_book("soft-limit-commit", chapters=1, scenes=1)
    stack.rt.catalog.import_book(book)
    stack.client.regenerate(book.book_id, ["audio"], [["ch1", "s1"]])
    wait_for(lambda: stack.events("job.started", book.book_id), 20, what="the job started")
    started = time.monotonic()
    postgres.stop_postgres()
    time.sleep(max(0.0, 4.5 - (time.monotonic() - started)))  # past the soft limit (3 s) before Postgres is back
    down = time.monotonic() - started
    assert postgres.start(redis=False, database="animastor_faults")["ANIMASTOR_DATABASE_URL"] == url
    wait_for(lambda: _usable(stack.rt.db), 10, what="the observer reconnected to Postgres")

    stack.wait_commands(book.book_id, ["audio"], "completed", timeout=60)
    starts = stack.events("job.started", book.book_id)
    assert len(starts) == 1, f"the scene ran {len(starts)} times: its first run's GPU work was thrown away"
    check_runs(stack, book.book_id, {("ch1", "s1", "audio")}, 1)
    [(open_start,)] = stack.query("SELECT open_dispatch FROM job_starts WHERE book_id = %s", (book.book_id,))
    assert open_start is None
    assert cluster.logs_mentioning("SoftTimeLimitExceeded") == [], "the soft time limit ended the task"
    [(_, said)] = cluster.logs_mentioning("soft time limit passed")  # the worker says it came and went
    figure(
        f"Postgres down {down:.1f}s from the job's start, the soft limit (3 s) inside it: ran once, committed once;"
        f" the worker said {said.split('] ', 1)[-1]!r}"
    )
