"""The book: what a reader imports, validated once at the edge.

Everything downstream (stores, dispatch, workers) trusts a `Book` because
`parse_book` refused anything it could not store, key, hash or show safely.
Pure: standard library only, no I/O.

Keys: a chapter is keyed by `chapter_id` (unique in the book); a scene is keyed
by the pair `(chapter_id, scene_id)`, so the same `scene_id` may appear in two
chapters. Ids are kept verbatim (no trimming, no Unicode normalisation); they may
contain `:`, `*`, `?`, `[`, `]`, `\\`, spaces and non-ASCII, so code that builds
Redis keys or globs from them must escape them.

See docs/book-format.md for the format and every limit.
"""

from __future__ import annotations

import re
import reprlib
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from animastor_tasks.errors import InvalidBook, InvalidInput

MAX_ID_CHARS = 200
MAX_TITLE_CHARS = 1_000
MAX_TEXT_CHARS = 100_000
MAX_PROMPT_CHARS = 10_000
SHOWN_VALUE_CHARS = 80
ROOT_PATH = "book"

# Invisible characters that reorder or hide text ("Trojan Source"): an id that
# renders like another id must not be a different key. Zero-width (non-)joiners
# stay allowed because real scripts need them.
_BIDI_AND_BOM = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\ufeff")
# Cc: C0/C1 controls and DEL; Cs: lone surrogates (cannot be encoded as UTF-8);
# Zl/Zp: U+2028/U+2029, which break lines in logs and JavaScript.
_ID_FORBIDDEN_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
# Free text (up to 100,000 characters) is scanned with a regex, not a Python loop.
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


@dataclass(frozen=True)
class Scene:
    """One unit of generation: its text feeds the audio stage, its prompt the image stage.

    `position` is the 0-based index in reading order across the whole book, so
    dispatch can take scenes in reading order without re-walking chapters.
    """

    chapter_id: str
    scene_id: str
    position: int
    text: str
    prompt: str = ""

    @property
    def key(self) -> tuple[str, str]:
        """The scene's identity in the book: ids are only unique per chapter."""
        return (self.chapter_id, self.scene_id)


@dataclass(frozen=True)
class Chapter:
    """A chapter; `position` is its 0-based index in the book."""

    chapter_id: str
    position: int
    title: str
    scenes: tuple[Scene, ...]


@dataclass(frozen=True)
class Book:
    """A validated book. Build one with `parse_book`, which sets the positions."""

    book_id: str
    title: str
    chapters: tuple[Chapter, ...]

    @property
    def scenes(self) -> tuple[Scene, ...]:
        """All scenes in reading order (their `position` order)."""
        return tuple(scene for chapter in self.chapters for scene in chapter.scenes)

    def chapter(self, chapter_id: str) -> Chapter:
        """The chapter with this id; KeyError if the book has none."""
        for chapter in self.chapters:
            if chapter.chapter_id == chapter_id:
                return chapter
        raise KeyError(chapter_id)

    def scene(self, chapter_id: str, scene_id: str) -> Scene:
        """The scene with this key; KeyError if the book has none."""
        for scene in self.chapter(chapter_id).scenes:
            if scene.scene_id == scene_id:
                return scene
        raise KeyError((chapter_id, scene_id))


# --------------------------------------------------------------------------- messages

_repr = reprlib.Repr()
_repr.maxstring = SHOWN_VALUE_CHARS
_repr.maxother = SHOWN_VALUE_CHARS
_repr.maxlist = 6
_repr.maxdict = 6
_repr.maxlevel = 3


def show_value(value: object) -> str:
    """`repr` of a refused value, short enough for one log line whatever its size."""
    if isinstance(value, str):
        if len(value) <= SHOWN_VALUE_CHARS:
            return repr(value)
        return f"{value[:SHOWN_VALUE_CHARS]!r}... ({len(value)} chars)"
    shown = _repr.repr(value)
    if len(shown) > SHOWN_VALUE_CHARS + 20:
        shown = shown[: SHOWN_VALUE_CHARS + 20] + "..."
    return shown


def _type_name(value: object) -> str:
    """The JSON name of a value's type, so messages speak the file's language."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _refuse(path: str, problem: str, value: object, error: type[InvalidInput] = InvalidBook) -> InvalidInput:
    return error(f"{path}: {problem}, got {show_value(value)}")


def _child(path: str, key: str) -> str:
    return key if path == ROOT_PATH else f"{path}.{key}"


# --------------------------------------------------------------------------- field rules


def _bad_id_char(value: str) -> tuple[int, str] | None:
    """First character an id may not hold, with its index, or None."""
    for index, ch in enumerate(value):
        if ch in _BIDI_AND_BOM or unicodedata.category(ch) in _ID_FORBIDDEN_CATEGORIES:
            return index, ch
    return None


def _describe(ch: str) -> str:
    """`U+000A (category Cc)` or `U+202E RIGHT-TO-LEFT OVERRIDE`: invisible characters need a name."""
    name = unicodedata.name(ch, "")
    return f"U+{ord(ch):04X} {name}" if name else f"U+{ord(ch):04X} (category {unicodedata.category(ch)})"


def validate_id(field_path: str, value: object, *, error: type[InvalidInput] = InvalidBook) -> str:
    """Check one id (book, chapter or scene) and return it unchanged.

    Shared with the command layer so an id typed in a command obeys exactly the
    rules of an imported one (pass `error=InvalidCommand` there). Refused: not a
    string, empty or whitespace-only, over 200 characters, or holding a control
    character (Unicode Cc), a lone surrogate, U+2028/U+2029, a bidi control or BOM.
    """
    if not isinstance(value, str):
        raise _refuse(field_path, f"must be a string, not {_type_name(value)}", value, error)
    if not value.strip():
        raise _refuse(field_path, "must not be empty or whitespace-only", value, error)
    if len(value) > MAX_ID_CHARS:
        raise _refuse(field_path, f"must be at most {MAX_ID_CHARS} characters (has {len(value)})", value, error)
    bad = _bad_id_char(value)
    if bad is not None:
        index, ch = bad
        raise _refuse(field_path, f"must not contain {_describe(ch)} at index {index}", value, error)
    return str(value)


def printable(text: str) -> str:
    """`text` with each character that is not printable written as Python writes it in a string (`\\n`, `\\x1b`,
    `\\u2028`). *Why:* words from outside (a server's, a generator plugin's) go into logs and onto terminals: a line
    break in them forged a log line of its own (`[GENERATE] ... ready`), an escape sequence rewrote the operator's
    terminal."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def storable(text: str) -> str:
    """Text from outside (a generator's error message) as Postgres and a UTF-8 log file can keep it: a NUL or a
    lone surrogate each becomes U+FFFD."""
    return UNSTORABLE.sub("\ufffd", text)


def check_storable(path: str, value: str, *, error: type[InvalidInput] = InvalidBook) -> None:
    """Free text may hold anything Postgres and UTF-8 can carry: no NUL, no lone surrogate."""
    found = UNSTORABLE.search(value)
    if found is not None:
        raise _refuse(path, f"must not contain {_describe(found.group())} at index {found.start()}", value, error)


def _text_field(
    obj: Mapping[str, Any], path: str, key: str, *, limit: int, required: bool, blank_ok: bool, single_line: bool
) -> str:
    field_path = _child(path, key)
    if key not in obj:
        if required:
            raise _missing(obj, field_path)
        return ""
    value = obj[key]
    if not isinstance(value, str):
        raise _refuse(field_path, f"must be a string, not {_type_name(value)}", value)
    if not blank_ok and not value.strip():
        raise _refuse(field_path, "must not be empty or whitespace-only", value)
    if len(value) > limit:
        raise _refuse(field_path, f"must be at most {limit} characters (has {len(value)})", value)
    if single_line:
        bad = _bad_id_char(value)
        if bad is not None:
            index, ch = bad
            raise _refuse(field_path, f"must not contain {_describe(ch)} at index {index}", value)
    else:
        check_storable(field_path, value)
    return str(value)


def _missing(obj: Mapping[str, Any], field_path: str) -> InvalidBook:
    present = sorted(str(k) for k in obj)
    return InvalidBook(f"{field_path}: required field is missing (fields present: {show_value(present)})")


def _object(path: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _refuse(path, f"must be a JSON object, not {_type_name(value)}", value)
    duplicates = getattr(value, "duplicate_keys", ())
    if duplicates:
        raise _refuse(path, "must not repeat a key", duplicates[0])
    return value


def _array(obj: Mapping[str, Any], path: str, key: str) -> list[Any]:
    field_path = _child(path, key)
    if key not in obj:
        raise _missing(obj, field_path)
    value = obj[key]
    if not isinstance(value, list):
        raise _refuse(field_path, f"must be an array, not {_type_name(value)}", value)
    return value


def _required_id(obj: Mapping[str, Any], path: str, key: str) -> str:
    field_path = _child(path, key)
    if key not in obj:
        raise _missing(obj, field_path)
    return validate_id(field_path, obj[key])


# --------------------------------------------------------------------------- parsing


def parse_book(doc: object) -> Book:
    """Validate a decoded book document and build the `Book`, or raise `InvalidBook`.

    The first problem found is reported, named by its JSON path (for example
    `chapters[1].scenes[3].scene_id`) with the offending value. Unknown keys are
    ignored so that newer files still import.
    """
    root = _object(ROOT_PATH, doc)
    book_id = _required_id(root, ROOT_PATH, "book_id")
    title = _text_field(
        root, ROOT_PATH, "title", limit=MAX_TITLE_CHARS, required=True, blank_ok=False, single_line=True
    )
    raw_chapters = _array(root, ROOT_PATH, "chapters")
    if not raw_chapters:
        raise _refuse("chapters", "a book needs at least one chapter", raw_chapters)

    chapters: list[Chapter] = []
    chapter_seen: dict[str, str] = {}
    position = 0
    for c_index, raw_chapter in enumerate(raw_chapters):
        c_path = f"chapters[{c_index}]"
        chapter_obj = _object(c_path, raw_chapter)
        chapter_id = _required_id(chapter_obj, c_path, "chapter_id")
        if chapter_id in chapter_seen:
            raise _refuse(
                f"{c_path}.chapter_id",
                f"chapter ids must be unique in the book; already used by {chapter_seen[chapter_id]}",
                chapter_id,
            )
        chapter_seen[chapter_id] = f"{c_path}.chapter_id"
        chapter_title = _text_field(
            chapter_obj, c_path, "title", limit=MAX_TITLE_CHARS, required=False, blank_ok=True, single_line=True
        )
        raw_scenes = _array(chapter_obj, c_path, "scenes")
        if not raw_scenes:
            raise _refuse(f"{c_path}.scenes", "a chapter needs at least one scene (empty chapters are refused)", [])

        scenes: list[Scene] = []
        scene_seen: dict[str, str] = {}
        for s_index, raw_scene in enumerate(raw_scenes):
            s_path = f"{c_path}.scenes[{s_index}]"
            scene_obj = _object(s_path, raw_scene)
            scene_id = _required_id(scene_obj, s_path, "scene_id")
            if scene_id in scene_seen:
                raise _refuse(
                    f"{s_path}.scene_id",
                    f"scene ids must be unique within their chapter; already used by {scene_seen[scene_id]}",
                    scene_id,
                )
            scene_seen[scene_id] = f"{s_path}.scene_id"
            text = _text_field(
                scene_obj, s_path, "text", limit=MAX_TEXT_CHARS, required=True, blank_ok=False, single_line=False
            )
            prompt = _text_field(
                scene_obj, s_path, "prompt", limit=MAX_PROMPT_CHARS, required=False, blank_ok=True, single_line=False
            )
            scenes.append(Scene(chapter_id, scene_id, position, text, prompt))
            position += 1
        chapters.append(Chapter(chapter_id, c_index, chapter_title, tuple(scenes)))

    return Book(book_id, title, tuple(chapters))


# --------------------------------------------------------------------------- export and hashing


def book_to_dict(book: Book) -> dict[str, Any]:
    """The JSON document for a book; `parse_book(book_to_dict(b)) == b` for any parsed book."""
    return {
        "book_id": book.book_id,
        "title": book.title,
        "chapters": [
            {
                "chapter_id": chapter.chapter_id,
                "title": chapter.title,
                "scenes": [
                    {"scene_id": scene.scene_id, "text": scene.text, "prompt": scene.prompt} for scene in chapter.scenes
                ],
            }
            for chapter in book.chapters
        ],
    }
