"""The artifact stores on real parts: the local directory, and an S3 bucket of a real `rclone serve s3` reached
through boto3 with the standard AWS variables; GPU jobs committing to the bucket, and the three ways a bucket
store goes wrong (wrong credentials, a missing bucket, an endpoint that stays down), each failing the job; an
endpoint down for a few seconds is waited out."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from animastor_tasks.adapters.artifacts import LocalArtifactStore, artifact_name, artifact_store
from animastor_tasks.adapters.s3_artifacts import S3ArtifactStore
from animastor_tasks.config import Settings
from animastor_tasks.dev.net import free_port
from animastor_tasks.dev.s3_server import INSTALL_HINT, S3Server, rclone_executable, start_s3_server
from animastor_tasks.errors import ArtifactStoreError, ConfigError
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow import status as status_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.worker import wiring
from animastor_tasks.worker.time_limit import TimeLimitedArtifacts
from animastor_tasks.worker.wiring import Wiring
from tests.support import missing, wait_for
from tests.support.cluster import Cluster
from tests.support.silent_server import silent_server

from .helpers import advertise, cli, make_book, states, use_settings
from .test_generate import dispatched_jobs, drain
from .test_schemas import check

AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if rclone_executable() is None:
        missing(INSTALL_HINT)
    server = start_s3_server(tmp_path_factory.mktemp("s3") / "root", bucket="animastor")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """This process (and the CLI it runs) configured for the bucket store under the prefix `books`."""
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3.env("books").items():
        monkeypatch.setenv(name, value)
    return s3


def uploads(store: S3ArtifactStore) -> list[str]:
    """The keys of every PutObject the store's real client sends from now on (a botocore event hook)."""
    sent: list[str] = []
    store.client.meta.events.register("before-call.s3.PutObject", lambda params, **_: sent.append(params["url_path"]))
    return sent


def rewire() -> Wiring:
    """This process's wiring rebuilt from the environment as a worker builds it (the store from the URL)."""
    wiring.reset()
    return wiring.current()


def artifact_rows(rt: Wiring, book: str) -> list[tuple[Any, ...]]:
    with rt.db.transaction() as conn:
        return conn.execute(
            "SELECT scene_id, sha256, size_bytes, uri FROM artifacts WHERE book_id = %s ORDER BY id", (book,)
        ).fetchall()


# -- choosing the store --------------------------------------------------------------------------------------


def test_the_url_chooses_the_store_and_the_root_keeps_working(tmp_path: Path) -> None:
    assert Settings.from_env({}).artifact_root == Path("artifacts")
    assert Settings.from_env({"ANIMASTOR_ARTIFACT_ROOT": "/srv/a"}).artifact_root == Path("/srv/a")
    for url in ("/srv/b", "file:///srv/b", "file://localhost/srv/b"):
        chosen = Settings.from_env({"ANIMASTOR_ARTIFACT_ROOT": "/srv/a", "ANIMASTOR_ARTIFACT_URL": url})
        assert (chosen.artifact_root, chosen.artifact_url) == (Path("/srv/b"), "")
    local = artifact_store(Settings.from_env({"ANIMASTOR_ARTIFACT_URL": str(tmp_path)}))
    assert isinstance(local, LocalArtifactStore) and local.root == tmp_path
    shared = Settings.from_env({"ANIMASTOR_ARTIFACT_URL": "s3://my-bucket/books/audio/"})
    assert shared.artifact_url == "s3://my-bucket/books/audio"
    assert shared.describe()["artifact_store"] == "s3://my-bucket/books/audio"
    store = artifact_store(shared)
    assert isinstance(store, S3ArtifactStore) and (store.bucket, store.prefix) == ("my-bucket", "books/audio")
    assert isinstance(artifact_store(Settings.from_env({"ANIMASTOR_ARTIFACT_URL": "s3://my-bucket"})), S3ArtifactStore)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"ANIMASTOR_ARTIFACT_URL": "s3://"}, "is not a bucket name"),
        ({"ANIMASTOR_ARTIFACT_URL": "s3://Books_2/x"}, "is not a bucket name"),
        ({"ANIMASTOR_ARTIFACT_URL": "s3://bucket:9000/x"}, "no credentials, port or query"),
        ({"ANIMASTOR_ARTIFACT_URL": "s3://key:hunter2@bucket/x"}, "no credentials, port or query"),
        ({"ANIMASTOR_ARTIFACT_URL": "s3://bucket/a//b"}, "without '//'"),
        # A server on a filesystem (rclone, MinIO's) resolves or refuses a `..` segment: keys outside the prefix.
        ({"ANIMASTOR_ARTIFACT_URL": "s3://bucket/books/../other"}, "'.' or '..'"),
        ({"ANIMASTOR_ARTIFACT_URL": "s3://bucket/./books"}, "'.' or '..'"),
        ({"ANIMASTOR_ARTIFACT_URL": "s3://bucket/.."}, "'.' or '..'"),
        ({"ANIMASTOR_ARTIFACT_URL": "s3://bucket/x?versionId=1"}, "no credentials, port or query"),
        ({"ANIMASTOR_ARTIFACT_URL": "ftp://host/dir"}, "must be a directory, file:///directory or s3://"),
        ({"ANIMASTOR_ARTIFACT_URL": "s3:bucket/dir"}, "must be a directory, file:///directory or s3://"),
        ({"ANIMASTOR_ARTIFACT_URL": "file://otherhost/dir"}, "must be file:///absolute/directory"),
        ({"ANIMASTOR_ARTIFACT_URL": "s3://bucket/x", "AWS_ENDPOINT_URL_S3": "127.0.0.1:9000"}, "AWS_ENDPOINT_URL_S3"),
        ({"ANIMASTOR_ARTIFACT_URL": "s3://bucket/x", "AWS_ENDPOINT_URL": "http://"}, "AWS_ENDPOINT_URL"),
    ],
)
def test_a_malformed_store_url_is_a_config_error_at_start(env: dict[str, str], said: str) -> None:
    with pytest.raises(ConfigError, match=r"ANIMASTOR_ARTIFACT_URL|AWS_ENDPOINT_URL") as raised:
        Settings.from_env(env)
    assert said in str(raised.value) and "hunter2" not in str(raised.value)


def test_the_cli_stops_at_start_on_a_malformed_store_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANIMASTOR_ARTIFACT_URL", "s3://Not_A_Bucket/x")
    done = cli("status", "b", "--json")
    assert done.returncode == 2 and "ANIMASTOR_ARTIFACT_URL" in done.stderr and "Traceback" not in done.stderr


# -- the stores ----------------------------------------------------------------------------------------------


def test_the_local_store_leaves_no_partial_file_and_rewrites_one_cut_short(tmp_path: Path, monkeypatch) -> None:
    """A write that failed (a full disk) left its `.tmp-` file for ever, and a file already at the content
    address was trusted whatever its size: one a crash cut short was never written again."""
    store = LocalArtifactStore(tmp_path / "artifacts")
    digest = hashlib.sha256(b"RIFF-audio").hexdigest()
    folder = tmp_path / "artifacts" / digest[:2]
    real_replace = os.replace

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(ArtifactStoreError, match="No space left"):
        store.put(b"RIFF-audio", "audio/wav")
    assert list(folder.iterdir()) == []
    monkeypatch.setattr(os, "replace", real_replace)
    (folder / f"{digest}.wav").write_bytes(b"RIFF")  # cut short
    store.put(b"RIFF-audio", "audio/wav")
    assert (folder / f"{digest}.wav").read_bytes() == b"RIFF-audio"


def test_the_local_store_keeps_bytes_once_and_records_a_file_uri(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "artifacts")
    first = store.put(b"RIFF-audio", "audio/wav")
    digest = hashlib.sha256(b"RIFF-audio").hexdigest()
    path = tmp_path / "artifacts" / digest[:2] / f"{digest}.wav"
    assert first == {**first, "sha256": digest, "size": 10, "uri": path.as_uri(), "path": str(path)}
    mtime = path.stat().st_mtime_ns
    assert store.put(b"RIFF-audio", "audio/wav") == first and path.stat().st_mtime_ns == mtime
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere: a file in the way of the folder fails for everyone
        with pytest.raises(ArtifactStoreError):
            LocalArtifactStore(tmp_path / "ro").put(b"x", "image/png")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ArtifactStoreError, match=r"artifact store file://.*/file: (FileExistsError|NotADirectory)"):
        LocalArtifactStore(tmp_path / "file").put(b"x", "image/png")


def test_the_local_store_writes_files_others_can_read_by_the_umask_under_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every artifact was mode 0600 (the temporary file's, kept by the rename): a reader's app or web server under
    another user could not open the `file://` URI that `status` gives. Its `path` was relative to the worker's
    working directory (the default root is `artifacts`)."""
    monkeypatch.chdir(tmp_path)
    old = os.umask(0o022)
    try:
        first = LocalArtifactStore(Path("artifacts")).put(b"RIFF-audio", "audio/wav")
        os.umask(0o077)
        second = LocalArtifactStore(Path("artifacts")).put(b"PNG-image", "image/png")
    finally:
        os.umask(old)
    assert Path(first["path"]).is_absolute() and Path(first["path"]).as_uri() == first["uri"]
    assert Path(first["path"]).stat().st_mode & 0o777 == 0o644
    assert Path(second["path"]).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("media_type", "suffix"),
    [("audio/mpeg", ".mp3"), ("audio/flac", ".flac"), ("audio/ogg", ".ogg"), ("audio/aac", ".aac"),
     ("Audio/WAV", ".wav"), ("audio/x-wav", ".wav"), ("image/jpeg", ".jpg"), ("image/webp", ".webp"),
     ("audio/wav; codecs=1", ".wav"), ("application/x-unknown", ".bin")],
)  # fmt: skip
def test_an_artifact_is_named_by_its_media_type(media_type: str, suffix: str) -> None:
    """Only `audio/wav` and `image/png` had an extension: the speech generator's MP3, FLAC, Ogg and AAC were
    stored as `.bin`, and `Audio/WAV` as `.bin` beside the same bytes' `.wav`."""
    assert artifact_name("ab" * 32, media_type) == f"ab/{'ab' * 32}{suffix}"


def test_the_s3_store_uploads_once_under_the_content_address(s3_env: S3Server) -> None:
    store = S3ArtifactStore("animastor", "books/unit")
    sent = uploads(store)
    data = b"\x89PNG fake image " * 1000
    digest = hashlib.sha256(data).hexdigest()
    record = store.put(data, "image/png")
    key = f"books/unit/{digest[:2]}/{digest}.png"
    assert record == {
        "sha256": digest,
        "size": len(data),
        "media_type": "image/png",
        "path": key,
        "uri": f"s3://animastor/{key}",
    }
    assert len(sent) == 1
    got = s3_env.client().get_object(Bucket="animastor", Key=key)
    assert hashlib.sha256(got["Body"].read()).hexdigest() == digest and got["ContentType"] == "image/png"
    assert {k.lower(): v for k, v in got["Metadata"].items()} == {"sha256": digest}
    assert store.put(data, "image/png") == record
    assert len(sent) == 1, "an object already in the bucket was uploaded again"
    store.put(b"other bytes", "audio/wav")
    assert len(sent) == 2
    print(f"s3 store: 3 puts, {len(sent)} uploads (1 skipped after a HEAD found it)")


def test_boto3_takes_the_endpoint_from_aws_endpoint_url_too(s3_env: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint)
    record = S3ArtifactStore("animastor", "generic").put(b"via AWS_ENDPOINT_URL", "audio/wav")
    assert s3_env.object_path(record["path"]).read_bytes() == b"via AWS_ENDPOINT_URL"


# -- GPU jobs committing to the bucket -----------------------------------------------------------------------


def test_jobs_commit_to_the_bucket_with_the_uri_in_status(rt: Wiring, s3_env: S3Server) -> None:
    rt = rewire()
    assert isinstance(rt.ports.artifacts, TimeLimitedArtifacts)  # the job's soft time limit fails an upload
    store = rt.ports.artifacts.inner
    assert isinstance(store, S3ArtifactStore) and store.url == "s3://animastor/books"
    sent = uploads(store)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    advertise(rt, "gpu.audio", "gpu.image")
    regenerate_flow.regenerate(rt.ports, "b", ["all"])
    results = drain(rt, "b")
    assert [r["outcome"] for r in results] == ["ready"] * 6
    assert set(states(rt, "b").values()) == {"ready"}

    done = cli("status", "b", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    check("status", status)
    client = s3_env.client()
    for scene in status["scenes"]:
        for stage, entry in scene["stages"].items():
            sha, uri = entry["artifact"], entry["artifact_uri"]
            ext = ".wav" if stage == "audio" else ".png"
            assert uri == f"s3://animastor/books/{sha[:2]}/{sha}{ext}"
            body = client.get_object(Bucket="animastor", Key=uri.removeprefix("s3://animastor/"))["Body"].read()
            assert hashlib.sha256(body).hexdigest() == sha
    rows = artifact_rows(rt, "b")
    assert len(rows) == 6 and all(uri.startswith("s3://animastor/books/") and size > 0 for _, _, size, uri in rows)
    assert len(sent) == len({sha for _, sha, _, _ in rows})

    # The same inputs again, forced: six more commits, and no byte uploaded twice.
    regenerate_flow.regenerate(rt.ports, "b", ["all"], force=True)
    again = drain(rt, "b")
    assert [r["outcome"] for r in again] == ["ready"] * 6
    rows = artifact_rows(rt, "b")
    print(f"s3 jobs: {len(rows)} commits, {len(sent)} uploads, {len({r[1] for r in rows})} distinct objects")
    assert len(rows) == 12 and len(sent) == len({sha for _, sha, _, _ in rows})


def test_a_real_gpu_worker_commits_to_the_bucket(rt: Wiring, s3_env: S3Server, tmp_path: Path) -> None:
    """A Celery GPU worker process configured only by the environment (ANIMASTOR_ARTIFACT_URL and AWS_*)."""
    cluster = Cluster(tmp_path / "cluster", {}, rt.presence)
    try:
        cluster.gpu("audio", timeout=90)
        rt.catalog.import_book(make_book("w", chapters=1, scenes=3))
        regenerate_flow.regenerate(rt.ports, "w", ["audio"])
        audio = lambda: {p: s for p, s in states(rt, "w").items() if p[2] == "audio"}  # noqa: E731
        wait_for(lambda: set(audio().values()) == {"ready"}, 60, "the worker's three audio pairs ready")
    finally:
        cluster.close()
    status = status_flow.status(rt.ports, "w")
    check("status", status)
    client = s3_env.client()
    for scene in status["scenes"]:
        entry = scene["stages"]["audio"]
        key = entry["artifact_uri"].removeprefix("s3://animastor/")
        assert key.startswith("books/") and key.endswith(".wav")
        assert (
            hashlib.sha256(client.get_object(Bucket="animastor", Key=key)["Body"].read()).hexdigest()
            == entry["artifact"]
        )
    assert not cluster.supervisor.survivors()


# -- a bad store ---------------------------------------------------------------------------------------------


def short_waits(rt: Wiring, *, soft_time_limit: int, **settings: Any) -> Wiring:
    """The jobs' soft time limit made short: a job waits for a store that does not answer until 90% of it has
    passed since it started. The store as wired; `settings`, any others changed with it."""
    store = rt.ports.artifacts
    limits = {"job_soft_time_limit": soft_time_limit, "job_time_limit": soft_time_limit + 1}
    use_settings(rt, replace(rt.settings, **limits, **settings))
    rt.ports = replace(rt.ports, artifacts=store)
    return rt


def test_an_endpoint_down_for_a_few_seconds_is_waited_out_and_nothing_is_lost(
    rt: Wiring, s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finished job's upload found the endpoint down (a restart of the store, say) and failed its pair for
    good: every scene that finished during an outage of a minute had to be regenerated by hand."""
    if rclone_executable() is None:
        missing(INSTALL_HINT)
    own = start_s3_server(tmp_path / "s3", bucket=s3_env.bucket, secret_key=s3_env.secret_key)
    for name, value in own.env("books").items():
        monkeypatch.setenv(name, value)
    rt = short_waits(rewire(), soft_time_limit=20)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    own.stop()
    put, tries, back = rt.ports.artifacts.put, [], []

    def put_while_down_then_back(data: bytes, media_type: str) -> dict[str, Any]:
        """The real upload; the store is started again after the third refused one (on this thread: a server
        started on a thread of its own dies with that thread)."""
        tries.append(1)
        if len(tries) == 4:
            back.append(start_s3_server(own.root, bucket=own.bucket, port=own.port, secret_key=own.secret_key))
        return put(data, media_type)

    monkeypatch.setattr(rt.ports.artifacts, "put", put_while_down_then_back)
    try:
        results = drain(rt, "b")
    finally:
        for server in back:
            server.stop()
    assert [r["outcome"] for r in results] == ["ready"] and len(tries) == 4, results
    [(_, sha, _, uri)] = artifact_rows(rt, "b")
    assert uri.startswith(f"s3://{own.bucket}/books/") and sha in uri
    assert (own.root / own.bucket / uri.split("/", 3)[3]).exists()


BAD_STORES = {
    "wrong_credentials": ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, "SignatureDoesNotMatch"),
    "bucket_missing": ({"ANIMASTOR_ARTIFACT_URL": "s3://no-such-bucket/books"}, "NoSuchBucket"),
    "endpoint_down": ({"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:{port}"}, "Could not connect to the endpoint URL"),
}


@pytest.mark.parametrize("case", sorted(BAD_STORES))
def test_a_bad_store_gives_the_pairs_back_and_opens_the_breaker(
    rt: Wiring, s3_env: S3Server, monkeypatch: pytest.MonkeyPatch, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store every upload hits alike (rotated keys, a bucket gone, an endpoint down past the job's share) failed
    every pair that finished meanwhile, for good, and the lane's breaker stayed closed: a whole library's scenes
    failed in a few minutes of GPU work. The scene is not to blame: the pair goes back, the breaker counts it."""
    change, said = BAD_STORES[case]
    for name, value in change.items():
        monkeypatch.setenv(name, value.format(port=free_port()))
    # An endpoint that does not answer is asked again for a while; two failures open the breaker.
    rt = short_waits(rewire(), soft_time_limit=2, breaker_threshold=2, breaker_cooldown_seconds=600)
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    results = drain(rt, "b")  # ends once the open breaker dispatches nothing more
    assert ("not written" in caplog.text) == (case == "endpoint_down")  # asked again only while it does not answer
    assert [r["outcome"] for r in results] == ["given_back", "given_back"], results
    assert all(said in r["error"] and r["error"].startswith("artifact store s3://") for r in results)
    audio = {pair: state for pair, state in states(rt, "b").items() if pair[2] == "audio"}
    assert set(audio.values()) == {"pending"}
    assert artifact_rows(rt, "b") == []
    assert rt.ports.breaker.breaker_state("gpu.audio") == "open"
    with rt.db.transaction() as conn:
        reasons = [r for (r,) in conn.execute("SELECT detail ->> 'reason' FROM events WHERE kind = 'job.given_back'")]
    assert len(reasons) == 2 and all(said in r for r in reasons), reasons
    [audio_command] = [c for c in rt.ports.commands.commands(book="b") if c.stage == "audio"]
    assert audio_command.status == "active"
    print(f"{case}: {results[0]['error']}")


def test_a_full_or_unwritable_artifact_directory_gives_the_pair_back(rt: Wiring, tmp_path: Path) -> None:
    """A local store that cannot take the file (a full disk, a read-only mount; here its root is a file) failed
    the pair for good, after its GPU work, and every pair of the lane after it."""
    (tmp_path / "not-a-directory").write_bytes(b"")
    use_settings(rt, replace(rt.settings, artifact_root=tmp_path / "not-a-directory", breaker_threshold=1))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    results = drain(rt, "b")
    assert [r["outcome"] for r in results] == ["given_back"], results
    assert "artifact store file://" in results[0]["error"], results
    assert {state for pair, state in states(rt, "b").items() if pair[2] == "audio"} == {"pending"}
    assert rt.ports.breaker.breaker_state("gpu.audio") == "open"


def test_the_temporary_files_killed_writers_left_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    """A writer killed mid-write (SIGKILL, a power cut) left its `.tmp-` file in a content folder, found by nothing
    ever again: a few killed writes of big media kept a disk full."""
    root = tmp_path / "artifacts"
    (root / ".tmp").mkdir(parents=True)
    stale, live = root / ".tmp" / "left-by-a-killed-writer", root / ".tmp" / "being-written"
    stale.write_bytes(b"x" * 1000)
    live.write_bytes(b"y")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    stored = LocalArtifactStore(root).put(b"RIFF-audio", "audio/wav")
    assert not stale.exists() and live.exists()
    assert Path(stored["path"]).read_bytes() == b"RIFF-audio"
    assert [p.name for p in Path(stored["path"]).parent.iterdir()] == [Path(stored["path"]).name]


def gpu_worker_start(env: dict[str, str], cwd: Path, seconds: float) -> subprocess.CompletedProcess[str] | str:
    """A GPU worker of the audio stage started with `env` (no Redis or Postgres listening: the store check runs
    before either is needed): its end, or its stderr so far when it is still running after `seconds`."""
    full = {
        **os.environ,
        "ANIMASTOR_LOCAL_DIR": str(cwd / "none"),
        "ANIMASTOR_REDIS_URL": "redis://127.0.0.1:1/0",
        "ANIMASTOR_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none",
        **env,
    }
    full.pop("ANIMASTOR_BROKER_URL", None)
    argv = [sys.executable, "-m", "animastor_tasks.operator.cli", "worker", "--stage", "audio", "-P", "solo"]
    try:
        return subprocess.run(argv, env=full, capture_output=True, text=True, timeout=seconds, cwd=cwd)
    except subprocess.TimeoutExpired as err:
        return err.stderr.decode() if isinstance(err.stderr, bytes) else str(err.stderr)


def test_a_gpu_worker_whose_artifact_store_refuses_uploads_refuses_to_start(s3: S3Server, tmp_path: Path) -> None:
    """A host with a wrong bucket, wrong keys or an artifact directory it cannot write started healthy and gave
    back every pair it ran, after the GPU work (before that, failed every one for good)."""
    (tmp_path / "a-file").write_bytes(b"")
    cases = {
        "artifact root not a directory": ({"ANIMASTOR_ARTIFACT_ROOT": str(tmp_path / "a-file")}, "Not a directory"),
        "bucket missing": ({**s3.env("books"), "ANIMASTOR_ARTIFACT_URL": "s3://no-such-bucket/x"}, "NoSuchBucket"),
        "wrong keys": ({**s3.env("books"), "AWS_SECRET_ACCESS_KEY": "not-it"}, "SignatureDoesNotMatch"),
    }
    for case, (env, said) in cases.items():
        done = gpu_worker_start(env, tmp_path, 30)
        assert not isinstance(done, str), f"{case}: the worker started: {done[-500:]}"
        assert done.returncode == 2 and "refusing to start" in done.stderr and said in done.stderr, (case, done.stderr)
    # A store that does not answer now may come back: the worker starts, saying so.
    down = {**s3.env("books"), "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "1"}
    running = gpu_worker_start(down, tmp_path, 12)
    assert isinstance(running, str) and "artifact store s3://" in running and "not reachable" in running, running
    with silent_server() as port:  # takes the connection, never answers: S3's retries took minutes
        silent = {**s3.env("books"), "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}
        running = gpu_worker_start(silent, tmp_path, 20)
    assert isinstance(running, str) and "no answer within 10 s: not reachable now" in running, running


class _RefusingBigOutputs:
    """The run's real store, refusing any output over `limit` bytes as a nearly full disk or a proxy's body limit
    would (413, EntityTooLarge, ENOSPC), and taking the rest."""

    def __init__(self, inner: Any, limit: int) -> None:
        self.inner, self.limit = inner, limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, data: bytes, media_type: str) -> dict[str, Any]:
        if len(data) > self.limit:
            raise ArtifactStoreError(self.inner.url, "OSError: [Errno 28] No space left on device")
        stored: dict[str, Any] = self.inner.put(data, media_type)
        return stored


def test_a_store_that_refuses_one_output_but_takes_others_fails_that_pair_once(rt: Wiring) -> None:
    """Given back on every refusal, a pair whose output alone the store refused ran its GPU work again without
    end: the other jobs' stored outputs kept the breaker closed, and the give-back closed the pair's start."""
    use_settings(rt, replace(rt.settings, breaker_threshold=2))
    rt.ports = replace(rt.ports, artifacts=_RefusingBigOutputs(rt.ports.artifacts, limit=64))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    results = drain(rt, "b")
    assert [r["outcome"] for r in results] == ["failed"], results
    assert "No space left on device" in results[0]["error"]
    assert {state for pair, state in states(rt, "b").items() if pair[2] == "audio"} == {"failed"}
    assert rt.ports.breaker.breaker_state("gpu.audio") == "closed"


EMPTY = hashlib.sha256(b"").hexdigest()


class _Throttling:
    """The run's real store, answering every upload SlowDown (its retries spent), yet taking the small probe."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, data: bytes, media_type: str) -> dict[str, Any]:
        raise ArtifactStoreError("s3://books", "SlowDown: reduce your request rate", unreachable=True)


def test_a_store_that_stays_throttled_gives_the_pair_back_even_if_it_takes_the_probe(rt: Wiring) -> None:
    """The probe after an unreachable store's last refusal got through (the outage over, or throttling letting one
    request by), and the pair failed for good as if the store had refused its output alone."""
    rt = short_waits(rt, soft_time_limit=2)
    rt.ports = replace(rt.ports, artifacts=_Throttling(rt.ports.artifacts))
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    [job] = dispatched_jobs(rt, "b")
    result = run_job(rt.ports, job, worker="test")
    assert result["outcome"] == "given_back" and "SlowDown" in result["error"], result


def test_the_local_probe_stores_as_an_output_is_stored(tmp_path: Path) -> None:
    """A `.tmp` on another filesystem than the content folders passed the probe (written and renamed inside `.tmp`)
    while every output's rename into its folder failed (EXDEV): the worker started healthy and failed every scene."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    root, elsewhere = tmp_path / "artifacts", shm / f"animastor-test-{os.getpid()}-{time.monotonic_ns()}"
    root.mkdir()
    elsewhere.mkdir()
    try:
        (root / ".tmp").symlink_to(elsewhere)
        with pytest.raises(ArtifactStoreError, match="cross-device"):
            LocalArtifactStore(root).probe()
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)
    LocalArtifactStore(tmp_path / "fine").probe()  # a root on one filesystem takes it (and keeps the empty artifact)
    fine = tmp_path / "fine"
    assert [p.relative_to(fine).as_posix() for p in fine.rglob("*") if p.is_file()] == [artifact_name(EMPTY, "x/y")]
