"""The local artifact store's root, given relative, stays where the process was when the store was made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from animastor_tasks.adapters.artifacts import LocalArtifactStore


def test_a_relative_root_does_not_follow_a_later_change_of_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Old code: a generator plugin's `os.chdir` moved every later output of the process to another folder (found by
    a plugin hunt)."""
    (tmp_path / "start").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "start")
    store = LocalArtifactStore(Path("arts"))
    os.chdir(tmp_path / "elsewhere")  # what the plugin did

    stored = store.put(b"RIFF", "audio/wav")

    assert Path(stored["path"]).is_relative_to(tmp_path / "start" / "arts"), stored["path"]
    assert not (tmp_path / "elsewhere" / "arts").exists()
