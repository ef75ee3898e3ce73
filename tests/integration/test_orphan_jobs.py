"""Running jobs whose pair is gone from Postgres (a re-import removed their scene) stop through reconcile.

The CLI lets go of a removed scene's job once, after the import's commit: killed in between, or Redis failing
on that call, the job renewed its lease and ran to its time limit, its output refused at its commit, while its
lane counted the slot free and sent another job to the GPUs meanwhile."""

from __future__ import annotations

import json
import time
from dataclasses import replace

from animastor_tasks.domain.book import book_to_dict, parse_book
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.reconcile import reconcile

from .helpers import advertise, cli, make_book, states
from .test_elastic_share import lane, run_control, waiting
from .test_generate import one_running_job


def _slow(rt):  # type: ignore[no-untyped-def]
    return replace(rt.settings.registry.get("audio"), lease_ttl=3, params={"steps": 100, "step_seconds": 0.1})


def test_reconcile_stops_the_job_of_a_scene_a_reimport_removed(rt, tmp_path) -> None:
    job, worker, outcome = one_running_job(rt, tmp_path, _slow(rt))
    advertise(rt, "gpu.audio", host="gpu@host")  # the job's worker node beats, as a real worker does
    time.sleep(0.3)
    edited = book_to_dict(make_book("b", chapters=1, scenes=1))
    edited["chapters"][0]["scenes"][0]["scene_id"] = "s1-renamed"  # s1 is gone
    summary = rt.catalog.import_book(parse_book(edited))  # no let_go: the CLI died, or Redis failed it
    assert summary.removed_jobs
    reconciled = time.monotonic()
    reconcile(rt.ports, force=True)
    assert rt.redis.client.exists(rt.redis.keys.lease(*job.lease_pair)) == 0
    worker.join(timeout=15)
    assert outcome.get("outcome") == "stopped", outcome
    assert time.monotonic() - reconciled < 5  # at its next lease renewal (1 s), not after its 10 s run


def test_reconcile_leaves_the_running_job_of_a_pair_still_its_own_alone(rt, tmp_path) -> None:
    spec = replace(_slow(rt), params={"steps": 15, "step_seconds": 0.1})
    job, worker, outcome = one_running_job(rt, tmp_path, spec)
    advertise(rt, "gpu.audio", host="gpu@host")
    time.sleep(0.3)
    reconcile(rt.ports, force=True)
    assert rt.redis.client.get(rt.redis.keys.lease(*job.lease_pair)) == job.dispatch_id
    worker.join(timeout=15)
    assert outcome.get("outcome") == "ready", outcome


def test_a_reimport_that_removes_queued_scenes_gives_their_slots_to_the_book_s_other_pairs(rt, tmp_path) -> None:
    """The CLI handed the removed jobs' slots to the other books waiting, never to the book itself: with none
    waiting they idled until the tick's pass of the book, 2.5 to 7 s in a hunt, while its other pairs waited."""
    lane(rt, lane_limit=2, book_quota=4, window=4)
    book = make_book("b", chapters=1, scenes=4)
    rt.catalog.import_book(book)
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])

    def generating() -> list[str]:
        return sorted(s for (_, s, _), state in states(rt, "b").items() if state == "generating")

    assert generating() == ["s1", "s2"] and list(waiting(rt)) == ["b"]
    edited = book_to_dict(book)
    edited["chapters"][0]["scenes"] = edited["chapters"][0]["scenes"][2:]  # s1 and s2 are gone
    (tmp_path / "b.json").write_text(json.dumps(edited))
    done = cli("book", "import", str(tmp_path / "b.json"))
    assert done.returncode == 0, done.stderr
    run_control(rt)
    assert generating() == ["s3", "s4"]
