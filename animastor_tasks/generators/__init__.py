"""The generator seam: what a job asks for, what it gets back, and how a stage finds its generator.

A stage names its generator (`StageSpec.generator`); the name is looked up in the
entry-point group `animastor_tasks.generators`, so a new backend is a package that
declares an entry point, not a change here. A factory is called as
`factory(spec, settings)` and returns an object with `generate(...)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from animastor_tasks.errors import ConfigError, GeneratorError

if TYPE_CHECKING:
    from animastor_tasks.config import Settings
    from animastor_tasks.domain.registry import StageSpec

ENTRY_POINT_GROUP = "animastor_tasks.generators"

__all__ = [
    "ENTRY_POINT_GROUP",
    "GenerationRequest",
    "Generator",
    "Media",
    "known_generators",
    "load_generator",
    "number_param",
]


@dataclass(frozen=True)
class GenerationRequest:
    """Everything a generator may use: ids for tracing, the scene input and the stage params."""

    book_id: str
    chapter_id: str
    scene_id: str
    stage: str
    input: str  # scene text (audio) or prompt (image)
    params: Mapping[str, Any]


@dataclass(frozen=True)
class Media:
    """The bytes a generator produced and their MIME type."""

    data: bytes
    media_type: str


@runtime_checkable
class Generator(Protocol):
    """A backend that turns one request into media.

    `should_stop()` must be polled often; when it answers True the generator raises
    `GenerationStopped` and produces nothing. `progress(fraction)` reports 0..1.
    Failures are `GeneratorError(message, retryable=...)`.
    """

    name: str

    def generate(
        self,
        request: GenerationRequest,
        should_stop: Callable[[], bool],
        progress: Callable[[float], None],
    ) -> Media: ...


@lru_cache(maxsize=1)
def _entry_points() -> dict[str, EntryPoint]:
    """Scanning installed distributions is slow, so it is done once per process."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_generators() -> tuple[str, ...]:
    """Names of the generators installed in this environment, sorted."""
    return tuple(sorted(_entry_points()))


def load_generator(spec: StageSpec, settings: Settings) -> Generator:
    """Build the generator configured for `spec`; ConfigError if its name is not installed."""
    found = _entry_points().get(spec.generator)
    if found is None:
        known = ", ".join(known_generators()) or "none"
        raise ConfigError(
            f"stage {spec.name!r}: generator {spec.generator!r} is not installed "
            f"(entry-point group {ENTRY_POINT_GROUP!r}; known: {known})"
        )
    factory = found.load()
    generator: Generator = factory(spec, settings)
    return generator


def number_param(
    params: Mapping[str, Any],
    key: str,
    default: float,
    *,
    minimum: float,
    maximum: float | None = None,
    integer: bool = False,
) -> float:
    """Read a numeric param; a bad value is a non-retryable GeneratorError naming the param.

    Params come from configuration, so a wrong one will fail the same way on every
    attempt: retrying it would only waste GPU time.
    """
    value = params.get(key, default)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and integer and value != int(value):
        ok = False
    if ok and not (value >= minimum and (maximum is None or value <= maximum)):
        ok = False
    if not ok:
        bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        kind = "an integer" if integer else "a number"
        raise GeneratorError(f"param {key!r} must be {kind} {bounds}, got {value!r}", retryable=False)
    return int(value) if integer else float(value)
