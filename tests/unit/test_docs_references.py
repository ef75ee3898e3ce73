"""What the docs tell a reader to import exists where they say, and the README lists the everyday commands."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/operations.md", "docs/book-format.md", "docs/deployment.md"]


def _resolves(dotted: str) -> bool:
    """Whether `dotted` is a module of the package, or a name defined in one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_path_in_the_docs_resolves(doc: str) -> None:
    named = set(re.findall(r"`(animastor_tasks(?:\.\w+)+)", (ROOT / doc).read_text()))
    assert {name for name in named if not _resolves(name)} == set()


@pytest.mark.parametrize("name", ["parse_book_json", "parse_book", "book_to_dict", "validate_id"])
def test_the_book_format_names_the_module_of_each_function_it_mentions(name: str) -> None:
    """It named `book_to_dict` and `validate_id` with no module, just after `domain.book_json`, where neither is."""
    text = (ROOT / "docs/book-format.md").read_text()
    qualified = re.findall(rf"`(animastor_tasks(?:\.\w+)+)\.{name}\b", text)
    assert qualified, f"{name} is never named with its module"
    for module in qualified:  # where it is defined, not a module that merely imports it
        found = getattr(importlib.import_module(module), name, None)
        assert getattr(found, "__module__", None) == module, f"{name} is not defined in {module}"


def test_the_readme_lists_layers_show_beside_layers_set() -> None:
    everyday = (ROOT / "README.md").read_text().partition("Everyday use:")[2].partition("```\n\n")[0]
    assert "animastor-tasks layers set BOOK" in everyday and "animastor-tasks layers show BOOK" in everyday
