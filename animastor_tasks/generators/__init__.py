"""The generator seam: what a job asks for, what it gets back, and how a stage finds its generator.

A stage names its generator (`StageSpec.generator`); the name is looked up in the
entry-point group `animastor_tasks.generators`, so a new backend is a package that
declares an entry point, not a change here. A factory is called as
`factory(spec, settings)` and returns an object with `generate(...)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from animastor_tasks.errors import ConfigError, GeneratorError
from animastor_tasks.ports import GenerationRequest, Generator, Media

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
        raise GeneratorError(f"param {key!r} must be {kind} {bounds}, got {value!r}", misconfigured=True)
    return int(value) if integer else float(value)


class EntryPointGenerators:
    """The flows' `Generators`: a stage's generator, found by its entry point and built per job."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def load(self, spec: StageSpec) -> Generator:
        return load_generator(spec, self.settings)
