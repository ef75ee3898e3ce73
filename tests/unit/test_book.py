"""Book parsing: what imports, what is refused, and how the refusal reads."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from animastor_tasks.dev.samples import load_sample_book, sample_book_path
from animastor_tasks.domain.book import (
    MAX_ID_CHARS,
    MAX_PROMPT_CHARS,
    MAX_TEXT_CHARS,
    Book,
    Chapter,
    Scene,
    book_to_dict,
    parse_book,
    validate_id,
)
from animastor_tasks.domain.book_json import parse_book_json
from animastor_tasks.domain.inputs import input_hash
from animastor_tasks.errors import InvalidBook, InvalidCommand, InvalidInput


def valid_doc() -> dict[str, Any]:
    return {
        "book_id": "b1",
        "title": "A Book",
        "chapters": [
            {
                "chapter_id": "c1",
                "title": "One",
                "scenes": [
                    {"scene_id": "s1", "text": "First.", "prompt": "a cat"},
                    {"scene_id": "s2", "text": "Second.", "prompt": "a dog"},
                ],
            },
            {
                "chapter_id": "c2",
                "title": "Two",
                "scenes": [
                    {"scene_id": "s1", "text": "Third.", "prompt": "a bird"},
                    {"scene_id": "s2", "text": "Fourth.", "prompt": "a fish"},
                    {"scene_id": "s3", "text": "Fifth.", "prompt": "a fox"},
                    {"scene_id": "s4", "text": "Sixth.", "prompt": "an owl"},
                ],
            },
        ],
    }


def refused(doc: object) -> str:
    with pytest.raises(InvalidBook) as info:
        parse_book(doc)
    return str(info.value)


# --------------------------------------------------------------------------- valid books


def test_valid_book_parses_with_positions_in_reading_order() -> None:
    book = parse_book(valid_doc())
    assert book.book_id == "b1"
    assert book.title == "A Book"
    assert [c.chapter_id for c in book.chapters] == ["c1", "c2"]
    assert [c.position for c in book.chapters] == [0, 1]
    assert [s.position for s in book.scenes] == list(range(6))
    assert [s.key for s in book.scenes] == [
        ("c1", "s1"),
        ("c1", "s2"),
        ("c2", "s1"),
        ("c2", "s2"),
        ("c2", "s3"),
        ("c2", "s4"),
    ]
    assert book.scenes[2] == Scene("c2", "s1", 2, "Third.", "a bird")
    assert book.scene("c2", "s3").text == "Fifth."
    assert book.chapter("c1").title == "One"


def test_lookup_of_unknown_key_raises_key_error() -> None:
    book = parse_book(valid_doc())
    with pytest.raises(KeyError):
        book.chapter("nope")
    with pytest.raises(KeyError):
        book.scene("c1", "s9")


def test_book_is_frozen() -> None:
    book = parse_book(valid_doc())
    with pytest.raises(AttributeError):
        book.title = "x"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        book.scenes[0].text = "x"  # type: ignore[misc]


def test_optional_fields_default_and_unknown_keys_are_ignored() -> None:
    doc = valid_doc()
    del doc["chapters"][0]["title"]
    del doc["chapters"][0]["scenes"][0]["prompt"]
    doc["future"] = {"anything": [1, 2]}
    doc["chapters"][1]["mood"] = "dark"
    doc["chapters"][1]["scenes"][0]["voice"] = "alto"
    book = parse_book(doc)
    assert book.chapters[0].title == ""
    assert book.scenes[0].prompt == ""
    assert book_to_dict(book)["chapters"][0]["scenes"][0]["prompt"] == ""


def test_same_scene_id_in_two_chapters_is_allowed() -> None:
    book = parse_book(valid_doc())
    assert book.scene("c1", "s1") != book.scene("c2", "s1")


@pytest.mark.parametrize("value", ["a:b", "*", "?[x]", "\\", "глава 1", "scene one", " padded ", "a]b[c", "书", "🙂"])
def test_hostile_but_allowed_ids_are_accepted_verbatim(value: str) -> None:
    doc = valid_doc()
    doc["book_id"] = value
    doc["chapters"][0]["chapter_id"] = value
    doc["chapters"][0]["scenes"][0]["scene_id"] = value
    book = parse_book(doc)
    assert book.book_id == value
    assert book.scenes[0].key == (value, value)
    assert validate_id("x", value) == value


def test_limits_are_inclusive() -> None:
    doc = valid_doc()
    doc["chapters"][0]["scenes"][0]["scene_id"] = "i" * MAX_ID_CHARS
    doc["chapters"][0]["scenes"][0]["text"] = "t" * MAX_TEXT_CHARS
    doc["chapters"][0]["scenes"][0]["prompt"] = "p" * MAX_PROMPT_CHARS
    book = parse_book(doc)
    assert len(book.scenes[0].scene_id) == MAX_ID_CHARS


def test_text_may_hold_newlines_tabs_and_any_script() -> None:
    doc = valid_doc()
    doc["chapters"][0]["scenes"][0]["text"] = "Line one.\n\tLine two — «ёж» 🙂"
    assert parse_book(doc).scenes[0].text == "Line one.\n\tLine two — «ёж» 🙂"


# --------------------------------------------------------------------------- refusals


def test_not_an_object_is_refused() -> None:
    for doc in ([1, 2], "book", None, 3):
        message = refused(doc)
        assert message.startswith("book: must be a JSON object")
        assert repr(doc) in message


def test_chapter_and_scene_not_objects_are_refused() -> None:
    doc = valid_doc()
    doc["chapters"][1] = "c2"
    assert refused(doc).startswith("chapters[1]: must be a JSON object, not string, got 'c2'")
    doc = valid_doc()
    doc["chapters"][1]["scenes"][2] = ["s3"]
    assert refused(doc).startswith("chapters[1].scenes[2]: must be a JSON object, not array, got ['s3']")


@pytest.mark.parametrize(
    ("path", "container"),
    [
        ("book_id", lambda d: d),
        ("title", lambda d: d),
        ("chapters", lambda d: d),
        ("chapters[1].chapter_id", lambda d: d["chapters"][1]),
        ("chapters[1].scenes", lambda d: d["chapters"][1]),
        ("chapters[1].scenes[3].scene_id", lambda d: d["chapters"][1]["scenes"][3]),
        ("chapters[1].scenes[3].text", lambda d: d["chapters"][1]["scenes"][3]),
    ],
)
def test_missing_required_field_is_refused(path: str, container: Any) -> None:
    doc = valid_doc()
    del container(doc)[path.rsplit(".", 1)[-1]]
    message = refused(doc)
    assert message.startswith(f"{path}: required field is missing")


@pytest.mark.parametrize(
    ("path", "setter", "bad"),
    [
        ("book_id", lambda d, v: d.__setitem__("book_id", v), 7),
        ("title", lambda d, v: d.__setitem__("title", v), None),
        ("chapters", lambda d, v: d.__setitem__("chapters", v), {"c1": []}),
        ("chapters[0].chapter_id", lambda d, v: d["chapters"][0].__setitem__("chapter_id", v), True),
        ("chapters[0].title", lambda d, v: d["chapters"][0].__setitem__("title", v), ["One"]),
        ("chapters[0].scenes", lambda d, v: d["chapters"][0].__setitem__("scenes", v), "s1"),
        ("chapters[1].scenes[3].scene_id", lambda d, v: d["chapters"][1]["scenes"][3].__setitem__("scene_id", v), 4),
        ("chapters[1].scenes[3].text", lambda d, v: d["chapters"][1]["scenes"][3].__setitem__("text", v), False),
        ("chapters[1].scenes[3].prompt", lambda d, v: d["chapters"][1]["scenes"][3].__setitem__("prompt", v), 1.5),
    ],
)
def test_wrong_type_is_refused(path: str, setter: Any, bad: object) -> None:
    doc = valid_doc()
    setter(doc, bad)
    message = refused(doc)
    assert message.startswith(f"{path}: must be ")
    assert message.endswith(f"got {bad!r}")


def test_bool_is_named_as_json_boolean() -> None:
    doc = valid_doc()
    doc["book_id"] = True
    assert refused(doc) == "book_id: must be a string, not boolean, got True"


def test_duplicate_scene_id_in_a_chapter_is_refused() -> None:
    doc = valid_doc()
    doc["chapters"][1]["scenes"][3]["scene_id"] = "s2"
    message = refused(doc)
    assert message.startswith("chapters[1].scenes[3].scene_id: scene ids must be unique within their chapter")
    assert "chapters[1].scenes[1].scene_id" in message
    assert message.endswith("got 's2'")


def test_duplicate_chapter_id_is_refused() -> None:
    doc = valid_doc()
    doc["chapters"][1]["chapter_id"] = "c1"
    message = refused(doc)
    assert message.startswith("chapters[1].chapter_id: chapter ids must be unique in the book")
    assert "chapters[0].chapter_id" in message
    assert message.endswith("got 'c1'")


def test_book_without_chapters_is_refused() -> None:
    doc = valid_doc()
    doc["chapters"] = []
    assert refused(doc) == "chapters: a book needs at least one chapter, got []"


def test_chapter_without_scenes_is_refused() -> None:
    doc = valid_doc()
    doc["chapters"][1]["scenes"] = []
    message = refused(doc)
    assert message.startswith("chapters[1].scenes: a chapter needs at least one scene")
    assert "empty chapters are refused" in message
    assert message.endswith("got []")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "must not be empty"),
        ("   ", "whitespace-only"),
        ("\t\n", "whitespace-only"),
        ("x" * (MAX_ID_CHARS + 1), f"at most {MAX_ID_CHARS} characters (has {MAX_ID_CHARS + 1})"),
        ("a\nb", "U+000A"),
        ("a\x00b", "U+0000"),
        ("a\x7fb", "U+007F"),
        ("a\x1bb", "U+001B"),
        ("a\x85b", "U+0085"),
        ("a\u2028b", "U+2028"),
        ("a\u2029b", "U+2029"),
        ("a\u202eb", "U+202E"),
        ("a\ufeffb", "U+FEFF"),
        ("a\ud800b", "U+D800"),
    ],
)
def test_bad_scene_id_is_refused_with_path_and_value(value: str, reason: str) -> None:
    doc = valid_doc()
    doc["chapters"][1]["scenes"][3]["scene_id"] = value
    message = refused(doc)
    assert message.startswith("chapters[1].scenes[3].scene_id: ")
    assert reason in message
    shown = repr(value) if len(value) <= 80 else repr(value[:80])
    assert shown in message


@pytest.mark.parametrize("field", ["book_id", "chapter_id"])
def test_bad_book_and_chapter_ids_are_refused(field: str) -> None:
    doc = valid_doc()
    target = doc if field == "book_id" else doc["chapters"][0]
    target[field] = "x\x00"
    path = "book_id" if field == "book_id" else "chapters[0].chapter_id"
    assert refused(doc).startswith(f"{path}: must not contain U+0000")


def test_long_values_are_truncated_in_the_message() -> None:
    doc = valid_doc()
    doc["chapters"][0]["scenes"][0]["text"] = "t" * (MAX_TEXT_CHARS + 1)
    message = refused(doc)
    assert message.startswith(f"chapters[0].scenes[0].text: must be at most {MAX_TEXT_CHARS} characters")
    assert f"got {'t' * 80!r}... ({MAX_TEXT_CHARS + 1} chars)" in message
    assert len(message) < 300


def test_overlong_prompt_is_refused() -> None:
    doc = valid_doc()
    doc["chapters"][1]["scenes"][0]["prompt"] = "p" * (MAX_PROMPT_CHARS + 1)
    assert refused(doc).startswith(f"chapters[1].scenes[0].prompt: must be at most {MAX_PROMPT_CHARS} characters")


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_blank_text_is_refused(text: str) -> None:
    doc = valid_doc()
    doc["chapters"][0]["scenes"][1]["text"] = text
    message = refused(doc)
    assert message.startswith("chapters[0].scenes[1].text: must not be empty")
    assert message.endswith(f"got {text!r}")


def test_text_with_nul_is_refused() -> None:
    doc = valid_doc()
    doc["chapters"][0]["scenes"][1]["text"] = "ok\x00no"
    assert refused(doc) == (
        "chapters[0].scenes[1].text: must not contain U+0000 (category Cc) at index 2, got 'ok\\x00no'"
    )


def test_prompt_with_lone_surrogate_is_refused() -> None:
    doc = valid_doc()
    doc["chapters"][1]["scenes"][2]["prompt"] = "sky \udc80"
    message = refused(doc)
    assert message.startswith("chapters[1].scenes[2].prompt: must not contain U+DC80 (category Cs) at index 4")
    assert message.endswith("got 'sky \\udc80'")


def test_blank_book_title_is_refused_but_blank_chapter_title_is_not() -> None:
    doc = valid_doc()
    doc["chapters"][0]["title"] = ""
    assert parse_book(doc).chapters[0].title == ""
    doc["title"] = " "
    assert refused(doc).startswith("title: must not be empty")


def test_large_bad_container_is_shown_briefly() -> None:
    doc = valid_doc()
    doc["chapters"] = {f"k{i}": list(range(1000)) for i in range(1000)}
    message = refused(doc)
    assert message.startswith("chapters: must be an array, not object")
    assert len(message) < 200


# --------------------------------------------------------------------------- JSON text


def test_parse_book_json_accepts_str_bytes_and_bom() -> None:
    raw = json.dumps(valid_doc(), ensure_ascii=False)
    expected = parse_book(valid_doc())
    assert parse_book_json(raw) == expected
    assert parse_book_json(raw.encode("utf-8")) == expected
    assert parse_book_json(b"\xef\xbb\xbf" + raw.encode("utf-8")) == expected


def test_broken_json_names_line_and_column() -> None:
    raw = '{\n  "book_id": "b1",\n  "title": "T"\n  "chapters": []\n}'
    with pytest.raises(InvalidBook) as info:
        parse_book_json(raw)
    message = str(info.value)
    assert message.startswith("book file is not valid JSON: Expecting ',' delimiter")
    assert "line 4 column 3" in message


def test_truncated_json_is_refused() -> None:
    with pytest.raises(InvalidBook, match="line 1 column"):
        parse_book_json(b'{"book_id": "b1", "chap')


def test_invalid_utf8_is_refused() -> None:
    with pytest.raises(InvalidBook, match=r"not valid UTF-8: byte b'\\xff' at line 2 column 13"):
        parse_book_json(b'{\n"book_id": "\xff"}')


def test_deeply_nested_json_is_refused() -> None:
    with pytest.raises(InvalidBook, match="not valid JSON"):
        parse_book_json("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_number_json_has_not_is_refused_wherever_it_stands(constant: str) -> None:
    """Named where it stands, as other JSON errors are; a string holding the word is no such number."""
    doc = '{"note": "NaN, Infinity",\n "extra": [1, ' + constant + "]," + json.dumps(valid_doc())[1:]
    with pytest.raises(InvalidBook) as info:
        parse_book_json(doc)
    assert str(info.value) == (
        f"book file is not valid JSON: {constant} is not a number JSON allows (JSON has no NaN or Infinity)"
        f" at line 2 column 15 (char {doc.index(constant, 30)})"
    )


def test_an_integer_too_long_to_read_is_refused_without_pythons_advice() -> None:
    with pytest.raises(InvalidBook) as info:
        parse_book_json('{"extra": ' + "7" * 5000 + "}")
    assert str(info.value) == (
        "book file is not valid JSON: Exceeds the limit (4300 digits) for integer string conversion:"
        " value has 5000 digits"
    )


def test_json_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidBook, match=r"^book: must be a JSON object, not array, got \[1, 2\]$"):
        parse_book_json("[1, 2]")


def test_repeated_json_key_is_refused_with_its_path() -> None:
    raw = json.dumps(valid_doc())
    raw = raw.replace('"scene_id": "s3"', '"scene_id": "s3", "scene_id": "s9"')
    with pytest.raises(InvalidBook) as info:
        parse_book_json(raw)
    assert str(info.value) == "chapters[1].scenes[2]: must not repeat a key, got 'scene_id'"


def test_wrong_raw_type_is_refused() -> None:
    with pytest.raises(InvalidBook, match="text or bytes"):
        parse_book_json(123)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- validate_id


def test_validate_id_returns_value_and_can_raise_other_errors() -> None:
    assert validate_id("command.scene_id", "s1") == "s1"
    with pytest.raises(InvalidBook, match=r"^command\.scene_id: must be a string, not null, got None$"):
        validate_id("command.scene_id", None)
    with pytest.raises(InvalidCommand, match=r"^command\.chapter_id: must not be empty"):
        validate_id("command.chapter_id", "", error=InvalidCommand)
    assert issubclass(InvalidBook, InvalidInput)


# --------------------------------------------------------------------------- input_hash


def test_input_hash_is_stable_and_sensitive() -> None:
    base = input_hash("Once upon a time.", "builtin:v1")
    assert base == input_hash("Once upon a time.", "builtin:v1")
    assert len(base) == 64
    assert int(base, 16) >= 0
    assert input_hash("Once upon a time!", "builtin:v1") != base
    assert input_hash("Once upon a time.", "builtin:v2") != base


def test_input_hash_is_unambiguous() -> None:
    assert input_hash("ab", "c") != input_hash("a", "bc")
    assert input_hash("a,b", "") != input_hash("a", "b")
    assert input_hash('a","b', "") != input_hash("a", "b")
    assert input_hash("", "x") != input_hash("x", "")


def test_input_hash_survives_any_string() -> None:
    assert len(input_hash("\ud800\x00🙂", "f")) == 64
    with pytest.raises(TypeError):
        input_hash(b"bytes", "f")  # type: ignore[arg-type]


@given(st.text(), st.text(), st.text(), st.text())
def test_input_hash_collides_only_for_equal_pairs(a: str, b: str, c: str, d: str) -> None:
    assert (input_hash(a, b) == input_hash(c, d)) == ((a, b) == (c, d))


# --------------------------------------------------------------------------- round trip


def _valid_id(value: str) -> bool:
    try:
        validate_id("x", value)
    except InvalidBook:
        return False
    return True


ids = st.text(min_size=1, max_size=12).filter(_valid_id)
storable = st.characters(codec="utf-8", exclude_characters="\x00")  # what text/prompt may hold
texts = st.text(storable, min_size=1, max_size=40).filter(str.strip)
prompts = st.text(storable, max_size=40)
titles = st.text(max_size=20).filter(_valid_id)


@st.composite
def books(draw: st.DrawFn) -> Book:
    chapter_ids = draw(st.lists(ids, min_size=1, max_size=4, unique=True))
    chapters: list[Chapter] = []
    position = 0
    for c_index, chapter_id in enumerate(chapter_ids):
        scene_ids = draw(st.lists(ids, min_size=1, max_size=4, unique=True))
        scenes = []
        for scene_id in scene_ids:
            scenes.append(Scene(chapter_id, scene_id, position, draw(texts), draw(prompts)))
            position += 1
        chapter_title = draw(st.one_of(st.just(""), titles))
        chapters.append(Chapter(chapter_id, c_index, chapter_title, tuple(scenes)))
    return Book(draw(ids), draw(titles.filter(str.strip)), tuple(chapters))


@settings(max_examples=60, deadline=None)
@given(books())
def test_book_to_dict_round_trips(book: Book) -> None:
    doc = book_to_dict(book)
    snapshot = copy.deepcopy(doc)
    assert parse_book(doc) == book
    assert doc == snapshot
    assert parse_book_json(json.dumps(doc)) == book
    assert parse_book_json(json.dumps(doc, ensure_ascii=False).encode("utf-8")) == book
    assert [s.position for s in book.scenes] == list(range(len(book.scenes)))


# --------------------------------------------------------------------------- sample


def test_sample_book_parses() -> None:
    book = load_sample_book()
    assert book.book_id == "lighthouse-keeper"
    assert len(book.chapters) >= 3
    assert 18 <= len(book.scenes) <= 24
    assert all(scene.text.strip() and scene.prompt.strip() for scene in book.scenes)
    assert parse_book_json(sample_book_path().read_bytes()) == book
