"""Python's cycle collector paused for the length of a gate pass.

A pass over a big book builds tens of thousands of row tuples that hold no reference cycles, and
reference counting frees them. With the collector on, each 700 allocations set off a collection
that walks the young rows again, and the rows that survive are walked again in the older
generations: a fifth of a pass over 100k pairs, measured (`bench/gate_pass.py`). Whatever cycles
are made meanwhile are collected once the collector is on again.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """No cycle collection inside the block; left as it was found (a caller that had paused it keeps it so)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
