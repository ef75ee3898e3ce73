"""The artifact store on a local directory (one machine), and the factory that picks the store a process
uses from its settings: this directory, or the S3 bucket that GPU hosts share (`ANIMASTOR_ARTIFACT_URL`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from animastor_tasks.config import Settings, split_s3_url
from animastor_tasks.errors import ArtifactStoreError
from animastor_tasks.ports import ArtifactStore

EXTENSIONS = {"audio/wav": ".wav", "image/png": ".png"}


def artifact_name(digest: str, media_type: str) -> str:
    """`ab/abcdef….wav`: the content address, fanned out by its first two hex digits (both stores)."""
    return f"{digest[:2]}/{digest}{EXTENSIONS.get(media_type, '.bin')}"


class LocalArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def url(self) -> str:
        return self.root.expanduser().resolve().as_uri()

    def put(self, data: bytes, media_type: str) -> dict[str, Any]:
        """Write the bytes under their sha256 (identical content is stored once), durably: flushed to disk and
        renamed into place, so that the commit that follows never names a file a power cut could leave empty.
        A file already there counts only with the right size (one cut short is written again), and a write
        that fails leaves no partial file behind: each failed job left one, and a full disk stayed full."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.root / artifact_name(digest, media_type)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.stat().st_size != len(data):
                _write_durably(path, data)
        except OSError as err:  # a full disk, a read-only mount: the job fails saying so
            raise ArtifactStoreError(self.url, f"{type(err).__name__}: {err}") from err
        uri = path.expanduser().resolve().as_uri()
        return {"sha256": digest, "size": len(data), "media_type": media_type, "path": str(path), "uri": uri}


def _write_durably(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
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
    if settings.artifact_url:
        from animastor_tasks.adapters.s3_artifacts import S3ArtifactStore  # boto3 only where S3 is used

        bucket, prefix = split_s3_url(settings.artifact_url)
        return S3ArtifactStore(bucket, prefix)
    return LocalArtifactStore(settings.artifact_root)
