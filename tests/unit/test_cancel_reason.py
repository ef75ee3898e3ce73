"""A cancel's reason is shown by `commands` and `status` on an operator's terminal: it may hold no control character.

*Why:* `cancel --reason $'x\\e]0;pwned\\a\\e[2J'` was stored and printed raw: the terminal took the escapes.
"""

from __future__ import annotations

import pytest

from animastor_tasks.errors import InvalidCommand
from animastor_tasks.flow import validate


@pytest.mark.parametrize(
    "reason",
    [
        "x\x1b]0;pwned\x07\x1b[2J",
        "two\nlines",
        "cr\rhere",
        "tab\there",
        "del\x7f",
        "c1\x9b2J",
        "ls\u2028x",
        "\u202eevil",
    ],
)
def test_a_reason_with_a_control_character_is_refused(reason: str) -> None:
    with pytest.raises(InvalidCommand) as info:
        validate.reason(reason)
    said = str(info.value)
    assert said.startswith("reason: must not contain U+") and said.isprintable()


@pytest.mark.parametrize("reason", [None, "", "moved to next week", "é 漢字 👩‍💻 [red]x[/]"])
def test_a_printable_reason_is_kept(reason: str | None) -> None:
    assert validate.reason(reason) == reason
