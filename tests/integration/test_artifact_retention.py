"""Artifact rows (never files) older than the journal retention whose sha256 is no longer their pair's are pruned
by reconcile, a slice of rows a pass; a pair's current artifact and a recent commit's row are kept. The table
grew by a row per committed job for ever (about 0.8 GB a day at 20 jobs/s). Real Postgres and Redis."""

from __future__ import annotations

from dataclasses import replace

from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, fake_artifact, make_book, use_settings


def commit(rt: Wiring, scene: str, sha: str, uri: str | None = None) -> str:
    """A forced regenerate of the scene's audio, its job committed with `sha` (stored at `uri`): the dispatch id."""
    regenerate_flow.regenerate(rt.ports, "b", ["audio"], [["ch1", scene]], force=True)
    with rt.db.read() as conn:
        token, dispatch_id = conn.execute(
            "SELECT fencing_token, dispatch_id FROM asset_states WHERE book_id = 'b' AND chapter_id = 'ch1'"
            " AND scene_id = %s AND stage = 'audio'",
            (scene,),
        ).fetchone()
    artifact = {**fake_artifact(sha), "uri": uri}
    assert rt.ports.jobs.commit_job("b", ("ch1", scene, "audio"), token, dispatch_id, artifact, "gpu.audio")
    return str(dispatch_id)


def age(rt: Wiring, dispatch_ids: list[str], days: float) -> None:
    with rt.db.transaction() as conn:
        conn.execute(
            "UPDATE artifacts SET created_at = now() - make_interval(secs => %s) WHERE dispatch_id = ANY(%s)",
            (days * 86400, dispatch_ids),
        )


def rows(rt: Wiring) -> set[str]:
    with rt.db.read() as conn:
        return {str(r[0]) for r in conn.execute("SELECT dispatch_id FROM artifacts")}


def test_reconcile_keeps_the_current_and_the_recent_artifact_rows_only(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    replaced, current = commit(rt, "s1", "a"), commit(rt, "s1", "b")
    recent, newest = commit(rt, "s2", "c"), commit(rt, "s2", "d")
    age(rt, [replaced, current], days=10)
    report = reconcile_flow.reconcile(rt.ports, force=True)
    assert report["pruned_artifacts"] == 1
    assert rows(rt) == {current, recent, newest}
    # The duplicate-dispatch check of a commit sent again still finds the current artifact's row.
    with rt.db.read() as conn:
        (token,) = conn.execute(
            "SELECT fencing_token FROM asset_states WHERE scene_id = 's1' AND stage = 'audio'"
        ).fetchone()
    assert rt.ports.jobs.commit_job("b", ("ch1", "s1", "audio"), token, current, fake_artifact("b"), "gpu.audio")
    assert reconcile_flow.reconcile(rt.ports, force=True)["pruned_artifacts"] == 0


def test_no_row_is_pruned_without_an_age_limit_or_within_a_visibility_timeout(rt) -> None:
    """Journal retention 0 (no age limit) keeps every artifact row; a retention shorter than the visibility timeout
    keeps a row for that long: a commit sent again (its answer lost) is answered from its row."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    replaced, current = commit(rt, "s1", "a"), commit(rt, "s1", "b")
    age(rt, [replaced], days=400)
    use_settings(rt, replace(rt.settings, journal_retention_days=0.0))
    assert reconcile_flow.reconcile(rt.ports, force=True)["pruned_artifacts"] == 0
    use_settings(rt, replace(rt.settings, journal_retention_days=0.001))  # 86 s
    age(rt, [replaced], days=0.01)  # 864 s, under the 3,600 s visibility timeout
    assert reconcile_flow.reconcile(rt.ports, force=True)["pruned_artifacts"] == 0
    age(rt, [replaced], days=0.05)
    assert reconcile_flow.reconcile(rt.ports, force=True)["pruned_artifacts"] == 1
    assert rows(rt) == {current}


def test_a_pass_looks_at_a_slice_of_rows_and_the_next_goes_on_from_it(rt) -> None:
    """Bounded per pass in rows looked at, not deleted: a farm's current artifacts (a row per pair, kept) would
    otherwise be read again by every pass before the first row to delete. A round ends at a row younger than the
    retention, and the next starts over (a current artifact replaced since is pruned then)."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    advertise(rt, "gpu.audio")
    old = [commit(rt, "s1", "a"), commit(rt, "s1", "b"), commit(rt, "s2", "c"), commit(rt, "s2", "d")]
    replaced = commit(rt, "s3", "e")
    age(rt, [*old, replaced], days=10)
    young = commit(rt, "s3", "f")
    journal = rt.ports.journal
    pruned, after = journal.prune_artifacts(7, 0, 2)
    assert pruned == 1 and after > 0 and rows(rt) == {old[1], *old[2:], replaced, young}
    pruned, after = journal.prune_artifacts(7, after, 2)
    assert pruned == 1 and after > 0
    pruned, after = journal.prune_artifacts(7, after, 2)  # `replaced`, then `young`: the round is done
    assert (pruned, after) == (1, 0) and rows(rt) == {old[1], old[3], young}
    with rt.db.transaction() as conn:  # a scene removed by a re-import: its old row is no pair's current one
        conn.execute("DELETE FROM scenes WHERE book_id = 'b' AND scene_id = 's1'")
    assert journal.prune_artifacts(7, 0, 100) == (1, 0) and rows(rt) == {old[3], young}


def test_rows_of_the_same_output_again_are_pruned_but_the_newest(rt) -> None:
    """A generator that gives the same bytes again (the builtin, a fixed seed, a cached server) made a row per run
    whose sha256 is its pair's current one: none was ever pruned (16 per pair after an hour's soak). The newest row of
    that output stands for it (`artifact_uris` reads it); the older ones go once past the retention."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    runs = [commit(rt, "s1", "same", f"s3://bucket/run{n}") for n in range(3)]
    unstored = commit(rt, "s1", "same")  # newer, but with no URI: the newest row with one still stands for it
    other = commit(rt, "s2", "same", "s3://bucket/other")  # another pair's row of the same bytes is its own
    age(rt, [*runs, unstored, other], days=10)
    assert rt.ports.assets.artifact_uris("b")[("ch1", "s1", "audio")] == "s3://bucket/run2"
    assert reconcile_flow.reconcile(rt.ports, force=True)["pruned_artifacts"] == 2
    assert rows(rt) == {runs[-1], unstored, other}
    uris = rt.ports.assets.artifact_uris("b")
    assert uris == {("ch1", "s1", "audio"): "s3://bucket/run2", ("ch1", "s2", "audio"): "s3://bucket/other"}
    assert reconcile_flow.reconcile(rt.ports, force=True)["pruned_artifacts"] == 0
