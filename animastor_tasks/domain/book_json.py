"""A book file's text: UTF-8 and JSON read strictly (a key given twice, NaN, broken text refused, each with where it
stands), then `parse_book`'s rules. Pure: standard library only, no I/O."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from animastor_tasks.domain.book import Book, parse_book
from animastor_tasks.errors import InvalidBook


class _KeyedObject(dict[str, Any]):
    """A decoded JSON object that remembers keys it saw twice (JSON keeps the last silently)."""

    duplicate_keys: tuple[str, ...] = ()


def _pairs_hook(pairs: list[tuple[str, Any]]) -> _KeyedObject:
    obj = _KeyedObject(pairs)
    if len(obj) != len(pairs):
        given = Counter(key for key, _ in pairs)
        obj.duplicate_keys = tuple(key for key in given if given[key] > 1)
    return obj


class NotANumber(ValueError):
    """`NaN`, `Infinity` or `-Infinity`: Python's reader takes them, JSON has none."""


def _not_a_number(name: str) -> float:
    raise NotANumber(f"{name} is not a number JSON allows (JSON has no NaN or Infinity)")


# A JSON string (skipped whole: it may hold the words), or one of the constants outside any string.
_STRING_OR_CONSTANT = re.compile(r'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)')


def _first_constant(text: str) -> int:
    return next((m.start(1) for m in _STRING_OR_CONSTANT.finditer(text) if m.group(1)), 0)


def _line_col(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def parse_book_json(raw: str | bytes) -> Book:
    """Decode a book file (UTF-8, optional BOM) and validate it; broken JSON names its line and column.

    A key repeated inside one object is refused: JSON parsers disagree on which
    copy wins, so the file is ambiguous.
    """
    if isinstance(raw, bytes | bytearray):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            prefix = bytes(raw)[: exc.start].decode("utf-8", "replace")
            line, col = _line_col(prefix, len(prefix))
            raise InvalidBook(
                f"book file is not valid UTF-8: byte {bytes(raw)[exc.start : exc.start + 1]!r} "
                f"at line {line} column {col} (byte offset {exc.start})"
            ) from None
    elif isinstance(raw, str):
        text = raw
    else:
        raise InvalidBook(f"book file must be text or bytes, not {type(raw).__name__}")
    text = text.removeprefix("\ufeff")
    try:
        doc = json.loads(text, object_pairs_hook=_pairs_hook, parse_constant=_not_a_number)
    except NotANumber as exc:  # where it stands: the parser names it alone
        line, col = _line_col(text, index := _first_constant(text))
        raise InvalidBook(f"book file is not valid JSON: {exc} at line {line} column {col} (char {index})") from None
    except json.JSONDecodeError as exc:
        raise InvalidBook(
            f"book file is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} (char {exc.pos})"
        ) from None
    except RecursionError:
        raise InvalidBook("book file is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # NaN, or an integer longer than Python's digit limit (not its advice to raise it)
        raise InvalidBook(f"book file is not valid JSON: {str(exc).partition('; use sys.')[0]}") from None
    return parse_book(doc)
