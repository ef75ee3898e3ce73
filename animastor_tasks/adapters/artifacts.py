"""The artifact store on a local directory (one machine), and the factory that picks the store a process
uses from its settings: this directory, or the S3 bucket that GPU hosts share (`ANIMASTOR_ARTIFACT_URL`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from animastor_tasks.config import Settings, split_s3_url
from animastor_tasks.domain.media_types import (
    AAC_TYPES,
    FLAC_TYPES,
    JPEG_TYPES,
    MP3_TYPES,
    OGG_TYPES,
    WAV_TYPES,
    base_type,
)
from animastor_tasks.errors import ArtifactStoreError
from animastor_tasks.ports import ArtifactStore

if TYPE_CHECKING:
    from animastor_tasks.adapters.s3_artifacts import S3ArtifactStore

# The media types the generators make or the media checks know; any other is `.bin`.
EXTENSIONS = {
    **dict.fromkeys(WAV_TYPES, ".wav"),
    **dict.fromkeys(MP3_TYPES, ".mp3"),
    **dict.fromkeys(AAC_TYPES, ".aac"),
    **dict.fromkeys(OGG_TYPES, ".ogg"),
    "audio/opus": ".opus",
    **dict.fromkeys(FLAC_TYPES, ".flac"),
    "audio/pcm": ".pcm",
    "image/png": ".png",
    **dict.fromkeys(JPEG_TYPES, ".jpg"),
    "image/webp": ".webp",
}


def artifact_name(digest: str, media_type: str) -> str:
    """`ab/abcdef….wav`: the content address, fanned out by its first two hex digits (both stores), named by its
    media type whatever its case or parameters (`Audio/WAV; codecs=1`)."""
    return f"{digest[:2]}/{digest}{EXTENSIONS.get(base_type(media_type), '.bin')}"


# A temporary file older than this is one its writer left when it died (a write takes seconds).
STALE_TEMPORARY_SECONDS = 3600.0


class LocalArtifactStore:
    """Files under `root`, each written in `root/.tmp/` first and renamed into place. The temporary files killed
    writers left (SIGKILL, a power cut: nothing ran to remove them) are swept at each process's first write, those
    over an hour old: left in the content folders, they were never found again, and a disk that a few killed
    writes of big media filled stayed full."""

    def __init__(self, root: Path) -> None:
        # Made absolute now: a relative root read at each write followed the process's working directory, which a
        # generator plugin may change (`os.chdir`), and the store was split between two folders without a word.
        self.root = root.expanduser().absolute()
        self._swept = False

    @property
    def url(self) -> str:
        return self.root.expanduser().resolve().as_uri()

    def put(self, data: bytes, media_type: str) -> dict[str, Any]:
        """Write the bytes under their sha256 (identical content is stored once), durably: flushed to disk and
        renamed into place, so that the commit that follows never names a file a power cut could leave empty.
        A file already there counts only with the right size (one cut short is written again), and a write
        that fails leaves no partial file behind: each failed job left one, and a full disk stayed full."""
        digest = hashlib.sha256(data).hexdigest()
        path = self._write(artifact_name(digest, media_type), data, unless_held=True)
        uri = path.as_uri()
        return {"sha256": digest, "size": len(data), "media_type": media_type, "path": str(path), "uri": uri}

    def probe(self) -> None:
        """Store the empty artifact (its own content address: harmless, kept) the way every output is stored,
        written in `.tmp` and renamed into its content folder, even when it is there: a root this process cannot
        write (not a directory, a read-only mount, a full disk, a `.tmp` on another filesystem) answers now, not
        after a job's GPU work."""
        self._write(artifact_name(hashlib.sha256(b"").hexdigest(), "application/octet-stream"), b"", unless_held=False)

    def _write(self, name: str, data: bytes, *, unless_held: bool) -> Path:
        """`unless_held`: a file already there with the right size is kept (one cut short is written again)."""
        root = self.root.expanduser().resolve()
        path = root / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not unless_held or not path.exists() or path.stat().st_size != len(data):
                temporary = root / ".tmp"
                temporary.mkdir(exist_ok=True)
                if not self._swept:
                    _sweep(temporary, time.time() - STALE_TEMPORARY_SECONDS)
                    self._swept = True
                _write_durably(path, data, temporary)
        except OSError as err:  # a full disk, a read-only mount: the job fails saying so
            raise ArtifactStoreError(self.url, f"{type(err).__name__}: {err}") from err
        return path


def _sweep(temporary: Path, before: float) -> None:
    """Remove the temporary files last written before `before` (best effort: another process may sweep too)."""
    with os.scandir(temporary) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < before:
                    os.unlink(entry.path)


def _write_durably(path: Path, data: bytes, temporary: Path) -> None:
    """Created 0666 less the umask, as any file the process writes: a temporary file's own 0600, kept by the rename,
    shut out every reader under another user (a web server serving the `file://` URIs)."""
    tmp = temporary / secrets.token_hex(8)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself
    finally:
        os.close(directory)


def artifact_store(settings: Settings) -> ArtifactStore:
    """The store `settings` name: the S3 bucket of `artifact_url` when set, else the directory `artifact_root`."""
    return _store(settings)


def probe_artifact_store(settings: Settings, within: float) -> None:
    """Whether the store `settings` name takes an upload now (`ArtifactStoreError` if not), for a GPU worker's
    start: a host with a wrong bucket, wrong keys or a directory it cannot write started healthy, then did the
    GPU work of every job it took for nothing. An answer not given `within` seconds counts as unreachable (an
    endpoint that takes the connection and never answers held the worker's start for minutes of S3 retries)."""
    store = _store(settings)
    answer: list[BaseException | None] = []

    def probe() -> None:
        try:
            store.probe()
        except BaseException as err:  # handed to the caller
            answer.append(err)
        else:
            answer.append(None)

    thread = threading.Thread(target=probe, name="artifact-store-probe", daemon=True)
    thread.start()
    thread.join(within)
    if not answer:
        raise ArtifactStoreError(store.url, f"no answer within {within:g} s", unreachable=True)
    if answer[0] is not None:
        raise answer[0]


def _store(settings: Settings) -> LocalArtifactStore | S3ArtifactStore:
    if settings.artifact_url:
        from animastor_tasks.adapters.s3_artifacts import S3ArtifactStore  # boto3 only where S3 is used

        bucket, prefix = split_s3_url(settings.artifact_url)
        return S3ArtifactStore(bucket, prefix)
    return LocalArtifactStore(settings.artifact_root)
