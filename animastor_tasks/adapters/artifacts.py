"""The artifact store on a local directory: bytes kept under their sha256."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

_EXTENSIONS = {"audio/wav": ".wav", "image/png": ".png"}


class LocalArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, data: bytes, media_type: str) -> dict[str, Any]:
        """Write the bytes under their sha256 (atomic rename; identical content is stored once)."""
        digest = hashlib.sha256(data).hexdigest()
        folder = self.root / digest[:2]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{digest}{_EXTENSIONS.get(media_type, '.bin')}"
        if not path.exists():
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
        return {"sha256": digest, "size": len(data), "media_type": media_type, "path": str(path)}
