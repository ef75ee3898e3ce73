"""The shapes every layer passes around, defined once."""

from __future__ import annotations

SceneKey = tuple[str, str]  # (chapter_id, scene_id)
Pair = tuple[str, str, str]  # (chapter_id, scene_id, stage): one unit of generated media
BookPair = tuple[str, str, str, str]  # (book_id, chapter_id, scene_id, stage): a pair named across books
