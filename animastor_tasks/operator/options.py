"""What the CLI's commands share: option types for seconds, and how an answer is printed (JSON or for people)."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from animastor_tasks.errors import AnimastorError


class OutputUnwritable(AnimastorError):
    """The answer could not be written to stdout (a full disk, a pipe its reader closed): exit 1, said on stderr."""


@contextmanager
def to_stdout() -> Iterator[None]:
    """Around what prints an answer or a view. *Why:* a full disk or a closed pipe was a raw traceback (exit 1), and
    a regenerate's note on how to read its answer again never came (`control_commands.regenerate`)."""
    try:
        yield
    except OSError as err:
        # What is left in stdout's buffer would fail again at exit, a second traceback: it goes nowhere now.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        raise OutputUnwritable(f"the answer could not be written to stdout: {err.strerror or err}") from err


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    with to_stdout():
        if as_json:
            click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
        else:
            human(data)


class Seconds(click.ParamType):
    """A finite number of seconds, at least `least` (above it when `open_low`) and at most `most`: `nan` and `inf`
    passed click's FloatRange, and were a traceback in `sleep` or a wait that never ended; `1e300` overflowed a
    sleep, or waited for ever on a command already sent."""

    name = "seconds"

    def __init__(self, least: float, most: float, *, open_low: bool = False) -> None:
        self.least, self.most, self.open_low = least, most, open_low

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        too_low = seconds <= self.least if self.open_low else seconds < self.least
        if not math.isfinite(seconds) or too_low:
            bound = f"above {self.least:g}" if self.open_low else f"at least {self.least:g}"
            self.fail(f"{value!r} must be a finite number {bound}", param, ctx)
        if seconds > self.most:
            self.fail(f"{value!r} must be at most {self.most:g}", param, ctx)
        return seconds


WAIT = Seconds(0, 86_400, open_low=True)  # how long a command waits for the control worker's answer: a day at most
INTERVAL = Seconds(0.1, 3_600)  # a --watch view's refresh: an hour at most
LOCK_WAIT = Seconds(0, 86_400)  # `db migrate --lock-wait`: `nan` or `inf` was a deadline never reached
