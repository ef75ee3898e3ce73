"""The bundled sample book, for demos, smoke tests and benchmarks.

Kept apart from `domain.book` so that the domain stays free of I/O.
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from animastor_tasks.domain.book import Book
from animastor_tasks.domain.book_json import parse_book_json

SAMPLE_BOOK_NAME = "sample_book.json"


def sample_book_path() -> Traversable:
    """Where the sample book lives, read through importlib.resources so zipped installs work.

    Falls back to the source tree when the resource API cannot resolve the
    package (Python 3.11 fails on namespace packages under editable installs).
    """
    try:
        resource = files("animastor_tasks.dev") / "data" / SAMPLE_BOOK_NAME
        if resource.is_file():
            return resource
    except (OSError, TypeError, ValueError, ModuleNotFoundError):
        pass
    return Path(__file__).resolve().parent / "data" / SAMPLE_BOOK_NAME


def load_sample_book() -> Book:
    """Read and validate the sample book; it must always parse."""
    return parse_book_json(sample_book_path().read_bytes())
