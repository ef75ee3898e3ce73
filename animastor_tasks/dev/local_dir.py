"""Where `animastor-tasks up` keeps its embedded servers.

Apart from the servers themselves so that every CLI call can ask "were local stores started
here?" without importing what starts them.
"""

from __future__ import annotations

import os
from pathlib import Path

LOCAL_DIR_VAR = "ANIMASTOR_LOCAL_DIR"


def default_data_dir() -> Path:
    """`$ANIMASTOR_LOCAL_DIR`, else `.animastor-local/` in the source checkout, else in the current directory."""
    override = os.environ.get(LOCAL_DIR_VAR, "").strip()
    if override:
        return Path(override).expanduser()
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        return root / ".animastor-local"
    return Path.cwd() / ".animastor-local"
