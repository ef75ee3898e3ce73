"""The fault suite's scale knob: `ANIMASTOR_FAULT_SCALE=long` (used by `make faults`) raises trial counts and
outage lengths; the default, `ci`, keeps the whole folder within about 5 minutes on a 2-core machine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Scale:
    name: str

    @property
    def long(self) -> bool:
        return self.name == "long"

    def pick(self, ci: T, long: T) -> T:
        return long if self.long else ci


def current() -> Scale:
    name = os.environ.get("ANIMASTOR_FAULT_SCALE", "ci").strip().lower() or "ci"
    if name not in ("ci", "long"):
        raise ValueError(f"ANIMASTOR_FAULT_SCALE={name!r}: expected 'ci' or 'long'")
    return Scale(name)
