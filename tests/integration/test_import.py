from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from animastor_tasks.adapters.postgres.migrations import migrate
from animastor_tasks.domain.book import Book, book_to_dict
from animastor_tasks.errors import InvalidBook

from .helpers import make_book, queued_messages, states


def test_import_creates_every_pair_dirty_and_queues_nothing(rt) -> None:
    summary = rt.catalog.import_book(make_book())
    assert summary.created and summary.scenes_added == 6
    found = states(rt, "b1")
    assert len(found) == 12 and set(found.values()) == {"dirty"}
    assert queued_messages(rt, "gpu.audio") == 0 and rt.ports.book_state.active_books() == set()


def imported_all_ready(rt) -> Book:  # type: ignore[no-untyped-def]
    """The sample book imported, every asset of it ready from its current inputs."""
    book = make_book()
    rt.catalog.import_book(book)
    with rt.db.transaction() as conn:
        conn.execute(
            "UPDATE asset_states a SET state = 'ready', artifact_sha256 = 'x', input_hash = s.input_hashes ->> a.stage"
            " FROM scenes s WHERE s.book_id = a.book_id AND s.chapter_id = a.chapter_id AND s.scene_id = a.scene_id"
        )
    return book


def test_reimport_dirties_only_ready_audio_of_changed_text(rt) -> None:
    book = imported_all_ready(rt)
    doc = book_to_dict(book)
    doc["chapters"][0]["scenes"][0]["text"] = "A different text"
    from animastor_tasks.domain.book import parse_book

    summary = rt.catalog.import_book(parse_book(doc))
    assert (summary.created, summary.scenes_changed, summary.assets_dirtied) == (False, 1, 1)
    found = states(rt, "b1")
    assert found[("ch1", "s1", "audio")] == "dirty"
    assert found[("ch1", "s1", "image")] == "ready"  # the prompt did not change
    assert sum(1 for v in found.values() if v == "ready") == 11
    assert queued_messages(rt, "gpu.audio") == 0


def test_a_reimport_by_a_process_that_does_not_know_a_stage_leaves_that_stages_media_alone(rt) -> None:
    """The import computes each stage's input hash with its own stage table: run from a shell whose
    ANIMASTOR_STAGES lacks a stage, it dropped that stage's hashes, so every ready asset of it was marked stale
    (and the active commands targeting them were released) although nothing of the book had changed."""
    from dataclasses import replace

    from animastor_tasks.adapters.postgres.catalog import Catalog
    from animastor_tasks.domain.book import parse_book

    book = imported_all_ready(rt)
    registry = rt.settings.registry
    audio_only = Catalog(rt.db, replace(registry, stages=(registry.get("audio"),)))
    assert audio_only.import_book(book).assets_dirtied == 0
    assert set(states(rt, "b1").values()) == {"ready"}
    doc = book_to_dict(book)
    doc["chapters"][0]["scenes"][0]["prompt"] = "A different picture"  # a change it cannot hash for images
    assert audio_only.import_book(parse_book(doc)).assets_dirtied == 1
    assert states(rt, "b1")[("ch1", "s1", "image")] == "dirty"
    assert rt.catalog.import_book(parse_book(doc)).assets_dirtied == 0  # the full table hashes it again


def test_reimport_removes_dropped_scenes(rt) -> None:
    rt.catalog.import_book(make_book(scenes=3))
    summary = rt.catalog.import_book(make_book(scenes=2))
    assert summary.scenes_removed == 2
    assert len(states(rt, "b1")) == 8


def test_migrate_is_idempotent(rt) -> None:
    assert migrate(rt.db) == []


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "animastor_tasks.operator.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_import_and_bad_input_writes_nothing(rt, tmp_path) -> None:
    good = tmp_path / "book.json"
    good.write_text(json.dumps(book_to_dict(make_book("cli-book"))))
    done = _cli("book", "import", str(good), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["scenes_added"] == 6

    bad = book_to_dict(make_book("bad-book"))
    bad["chapters"][1]["scenes"][2]["scene_id"] = "s1"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    refused = _cli("book", "import", str(path))
    assert refused.returncode == 2
    assert "chapters[1].scenes[2].scene_id" in refused.stderr and "'s1'" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not rt.catalog.book_exists("bad-book")

    broken = _cli("book", "import", "-", stdin="{not json")
    assert broken.returncode == 2 and "line 1" in broken.stderr

    endless = _cli("book", "import", "/dev/zero")  # read whole, it took the host's memory until the OOM killer came
    assert endless.returncode == 2 and "'/dev/zero' is larger than 256 MiB" in endless.stderr, endless.stderr


def test_cli_store_down_exits_3_without_password(rt, tmp_path) -> None:
    path = tmp_path / "book.json"
    path.write_text(json.dumps(book_to_dict(make_book("x"))))
    env_url = "postgresql://postgres:s3cret@127.0.0.1:1/none"
    done = subprocess.run(
        [sys.executable, "-m", "animastor_tasks.operator.cli", "book", "import", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "ANIMASTOR_DATABASE_URL": env_url},
    )
    assert done.returncode == 3, done.stderr
    assert "postgres unavailable" in done.stderr and "s3cret" not in done.stderr


def test_invalid_book_from_python_writes_nothing(rt) -> None:
    from animastor_tasks.domain.book import parse_book

    with pytest.raises(InvalidBook, match="chapters"):
        parse_book({"book_id": "b", "title": "t", "chapters": []})
    assert not rt.catalog.book_exists("b")


def test_persisted_transitions_are_compare_and_set(rt) -> None:
    from animastor_tasks.domain.vocabulary import AssetState
    from animastor_tasks.errors import InvalidTransition

    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    pairs = [("ch1", "s1", "audio"), ("ch1", "s2", "audio")]
    # Both rows are dirty: a release (which expects `pending`) changes nothing and says so.
    assert rt.ports.assets.release_denied("b", pairs) == []
    assert set(states(rt, "b").values()) == {"dirty"}
    # An edge the FSM does not have is refused before any SQL runs.
    with pytest.raises(InvalidTransition, match=r"'generating'.*'generating'"):
        rt.ports.assets.expire_generating("b", pairs[0], 0, AssetState.GENERATING, lambda: True)
    assert not rt.ports.assets.expire_generating("b", pairs[0], 0, AssetState.PENDING, lambda: True)


def test_a_reimport_that_drops_or_changes_a_commanded_scene_lets_its_command_end(rt) -> None:
    """A target whose scene a re-import removed (no pair left) or whose ready media it found stale (`dirty`)
    was counted open for ever: the command stayed active once its other targets were done."""
    from animastor_tasks.domain.book import parse_book
    from animastor_tasks.flow import regenerate as regenerate_flow
    from animastor_tasks.flow.generate import run_job

    from .helpers import advertise
    from .test_generate import dispatched_jobs

    book = make_book("b", chapters=1, scenes=3)
    rt.catalog.import_book(book)
    advertise(rt, "gpu.audio")
    [created] = regenerate_flow.regenerate(rt.ports, "b", ["audio"])["commands"]
    jobs = {job.scene_id: job for job in dispatched_jobs(rt, "b")}
    assert run_job(rt.ports, jobs["s1"], worker="w")["outcome"] == "ready"
    doc = book_to_dict(book)
    doc["chapters"][0]["scenes"][0]["text"] = "A different text"  # s1's media is stale now
    del doc["chapters"][0]["scenes"][2]  # s3 is gone
    rt.catalog.import_book(parse_book(doc))
    assert run_job(rt.ports, jobs["s2"], worker="w")["outcome"] == "ready"
    [command] = rt.ports.commands.commands(command_ids=[created["command_id"]])
    assert command.status == "failed"
    assert command.released == {"input_changed": 1, "scene_removed": 1}


def test_an_import_into_a_read_only_postgres_is_a_store_error_not_a_traceback(rt, tmp_path) -> None:
    """During a failover the URL may still reach the demoted primary or a standby: a write there raised psycopg's
    ReadOnlySqlTransaction, not counted as a store error, and the CLI printed a traceback (exit 1)."""
    path = tmp_path / "book.json"
    path.write_text(json.dumps(book_to_dict(make_book("standby-book"))))
    role = f"animastor_standby_{uuid.uuid4().hex[:8]}"  # every session of it read-only, as on a standby
    with rt.db.transaction() as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
        conn.execute(f"ALTER ROLE {role} SET default_transaction_read_only = on")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "animastor_tasks.operator.cli", "book", "import", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "ANIMASTOR_DATABASE_URL": rt.settings.database_url.replace("postgres@", f"{role}@")},
        )
    finally:
        with rt.db.transaction() as conn:
            conn.execute(f"DROP ROLE {role}")
    assert done.returncode == 3, done.stderr
    assert "read-only" in done.stderr and "Traceback" not in done.stderr
    assert not rt.catalog.book_exists("standby-book")


def test_a_reimport_that_removes_a_scene_stops_the_job_running_it(rt, tmp_path) -> None:
    """The import deleted the scene's pairs and left their jobs alone: a running one renewed its lease and ran to
    its end (up to the soft time limit), its output refused at commit, while its lane counted the slot free and
    sent another job to the lane's GPUs meanwhile."""
    from dataclasses import replace

    from .test_generate import one_running_job

    slow = replace(rt.settings.registry.get("audio"), lease_ttl=3, params={"steps": 100, "step_seconds": 0.1})
    job, worker, outcome = one_running_job(rt, tmp_path, slow)
    time.sleep(0.3)
    edited = book_to_dict(make_book("b", chapters=1, scenes=1))
    edited["chapters"][0]["scenes"][0]["scene_id"] = "s1-renamed"  # s1 is gone
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(edited))
    imported = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "animastor_tasks.operator.cli", "book", "import", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["scenes_removed"] == 1
    worker.join(timeout=15)
    assert outcome.get("outcome") == "stopped", outcome
    assert time.monotonic() - imported < 8  # at its next lease renewal, not after its 10 s run (a CLI start in it)
    assert rt.redis.client.exists(rt.redis.keys.lease(*job.lease_pair)) == 0


def test_a_reimport_from_a_shell_without_a_stage_still_releases_that_stage_s_removed_targets(rt) -> None:
    """A scene removed by an import from a shell whose stage table lacks `image` (the default one, say): only the
    stages it knew had their targets released, and the image command waited on its removed target for ever."""
    from dataclasses import replace

    from animastor_tasks.adapters.postgres.catalog import Catalog
    from animastor_tasks.domain.book import parse_book
    from animastor_tasks.flow import regenerate as regenerate_flow

    from .helpers import advertise

    book = make_book("b", chapters=1, scenes=2)
    rt.catalog.import_book(book)
    advertise(rt, "gpu.image")
    [created] = regenerate_flow.regenerate(rt.ports, "b", ["image"])["commands"]
    registry = rt.settings.registry
    audio_only = Catalog(rt.db, replace(registry, stages=(registry.get("audio"),)))
    doc = book_to_dict(book)
    del doc["chapters"][0]["scenes"][1]  # s2 is gone
    audio_only.import_book(parse_book(doc))
    [command] = rt.ports.commands.commands(command_ids=[created["command_id"]])
    assert command.released == {"scene_removed": 1}


_SCENE_ROWS = "SELECT chapter_id || '/' || scene_id, xmin::text FROM scenes WHERE book_id = 'b1'"
_BOOK_LOCKS = (  # this run's database only: other runs share the server
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def test_a_reimport_hashes_outside_the_book_lock_and_writes_only_the_scenes_that_changed(rt, monkeypatch) -> None:
    """A job's commit or a claim waits for its book's lock (holding its lane's lock, until they took the book's
    first): an import that hashed and rewrote every scene under the book lock (7.6 s of hashing alone for 100,000
    scenes) held the book's jobs up that long, and every book of the lane with them."""
    from animastor_tasks.adapters.postgres import catalog as catalog_module
    from animastor_tasks.domain.book import parse_book

    book = imported_all_ready(rt)
    with rt.db.read() as conn:
        before = dict(conn.execute(_SCENE_ROWS).fetchall())
    hashed = catalog_module.scene_hashes
    held_while_hashing: list[int] = []

    def hash_and_look(*args, **kwargs):  # type: ignore[no-untyped-def]
        with rt.db.read() as conn:  # another session: is the book's lock held now?
            [(held,)] = conn.execute(_BOOK_LOCKS).fetchall()
        held_while_hashing.append(held)
        return hashed(*args, **kwargs)

    monkeypatch.setattr(catalog_module, "scene_hashes", hash_and_look)
    doc = book_to_dict(book)
    doc["chapters"][0]["scenes"][0]["text"] = "A different text"
    summary = rt.catalog.import_book(parse_book(doc))
    assert summary.scenes_changed == 1 and summary.assets_dirtied == 1
    assert held_while_hashing and set(held_while_hashing) == {0}, held_while_hashing
    with rt.db.read() as conn:
        after = dict(conn.execute(_SCENE_ROWS).fetchall())
    rewritten = sorted(scene for scene, xmin in after.items() if before[scene] != xmin)
    assert rewritten == ["ch1/s1"], rewritten


def test_a_job_that_commits_after_a_reimport_changed_its_input_leaves_its_media_stale(rt, tmp_path) -> None:
    """A job that started on the old text and committed after an import changed it landed `ready` with the old
    hash (the import marks only `ready` pairs stale; this one was `generating`): the scene read as ready with media
    that no longer matched its text and its command counted it done, until the next import, an identical one,
    found it stale and released the target (the command then failed). The commit now does what that import would
    have done: the pair `dirty`, its target released `input_changed`; its slot is handed on as for any commit. The
    job says so (outcome and counter `outdated`): it said `ready`, for a pair that was not."""
    from dataclasses import replace

    from animastor_tasks.domain.book import parse_book
    from animastor_tasks.flow import regenerate as regenerate_flow
    from animastor_tasks.flow.generate import run_job

    from .helpers import advertise
    from .test_generate import dispatched_jobs, with_stage

    with_stage(rt, replace(rt.settings.registry.get("audio"), book_cap=1), tmp_path)
    book = make_book("b", chapters=1, scenes=2)
    rt.catalog.import_book(book)
    advertise(rt, "gpu.audio")
    [created] = regenerate_flow.regenerate(rt.ports, "b", ["audio"], force=False)["commands"]
    [job] = dispatched_jobs(rt, "b")
    doc = book_to_dict(book)
    doc["chapters"][0]["scenes"][0]["text"] = "A different text"
    commit = rt.ports.jobs.commit_job

    def edited_then_committed(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert rt.catalog.import_book(parse_book(doc)).assets_dirtied == 0  # s1 is generating: not marked
        return commit(*args, **kwargs)

    rt.ports.jobs.commit_job = edited_then_committed  # type: ignore[method-assign]
    try:
        assert (job.scene_id, run_job(rt.ports, job, worker="w")["outcome"]) == ("s1", "outdated")
    finally:
        del rt.ports.jobs.commit_job
    rt.ports.counters.flush()
    counted = rt.ports.counters.read()
    assert (counted.get("job:outdated:audio"), counted.get("job:ready:audio")) == ("1", None)
    found = states(rt, "b")
    assert found[("ch1", "s1", "audio")] == "dirty"
    assert found[("ch1", "s2", "audio")] == "generating"  # the freed slot went on to the next scene
    [command] = rt.ports.commands.commands(command_ids=[created["command_id"]])
    assert command.released == {"input_changed": 1} and command.status == "active"
    assert rt.catalog.import_book(parse_book(doc)).assets_dirtied == 0  # an identical re-import changes nothing
    [next_job] = dispatched_jobs(rt, "b")
    assert run_job(rt.ports, next_job, worker="w")["outcome"] == "ready"
    [command] = rt.ports.commands.commands(command_ids=[created["command_id"]])
    assert (command.status, command.released) == ("failed", {"input_changed": 1})
