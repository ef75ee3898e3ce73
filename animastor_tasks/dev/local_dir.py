"""Where `animastor-tasks up` keeps its embedded servers.

Apart from the servers themselves so that every CLI call can ask "were local stores started
here?" without importing what starts them.
"""

from __future__ import annotations

import os
from pathlib import Path

from animastor_tasks.errors import ConfigError

LOCAL_DIR_VAR = "ANIMASTOR_LOCAL_DIR"


def default_data_dir() -> Path:
    """`$ANIMASTOR_LOCAL_DIR`, else `.animastor-local/` in the source checkout, else in the current directory."""
    override = os.environ.get(LOCAL_DIR_VAR, "").strip()
    if override:
        path = Path(override).expanduser()
        if path.exists() and not path.is_dir():  # *why:* `down` was a NotADirectoryError traceback (exit 1)
            raise ConfigError(f"{LOCAL_DIR_VAR}: {override!r} is not a directory")
        return path
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        return root / ".animastor-local"
    return Path.cwd() / ".animastor-local"
