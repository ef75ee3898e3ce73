"""The in-process generator: real WAV/PNG files made on the CPU in milliseconds.

It lets the whole pipeline run (and be tested) without a GPU or an inference
service, while still behaving like a slow, interruptible, sometimes failing job
when the params ask it to.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from animastor_tasks.domain.media_types import base_type
from animastor_tasks.errors import GenerationStopped, GeneratorError
from animastor_tasks.generators import GenerationRequest, Media, number_param
from animastor_tasks.generators.media import render_png, synthesize_wav

if TYPE_CHECKING:
    from animastor_tasks.config import Settings
    from animastor_tasks.domain.registry import StageSpec

WAV_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave"})
PNG_TYPES = frozenset({"image/png"})
OCTET_STREAM = "application/octet-stream"
SLICE_SECONDS = 0.05  # a stop request is noticed within this long while a step sleeps


class BuiltinGenerator:
    """Produces media by `spec.media_type`: WAV for audio, PNG for images, a hash blob otherwise.

    Params (from `request.params`): `steps` (int >= 1, default 4), `step_seconds`
    (seconds each step sleeps, default 0), `fail_rate` (0..1 chance of a retryable
    failure half-way through, default 0).
    """

    name: str = "builtin"

    def __init__(self, spec: StageSpec, settings: Settings) -> None:
        self.spec = spec
        self.settings = settings
        _knobs(spec.params)  # a bad one stops the worker's start, not each job (`refuse_generators_not_built`)

    def generate(
        self,
        request: GenerationRequest,
        should_stop: Callable[[], bool],
        progress: Callable[[float], None],
    ) -> Media:
        steps, step_seconds, fail_rate = _knobs(request.params)
        # Draw once per attempt so fail_rate is the probability that an attempt fails.
        fail_at = steps // 2 if fail_rate > 0 and random.random() < fail_rate else None

        for step in range(steps):
            self._check_stop(should_stop, request)
            if step == fail_at:
                raise GeneratorError(
                    f"builtin generator: injected failure at step {step + 1}/{steps} "
                    f"(fail_rate={fail_rate}) for scene {request.scene_id} stage {request.stage}",
                    retryable=True,
                )
            self._sleep(step_seconds, should_stop, request)
            progress((step + 1) / steps)
        self._check_stop(should_stop, request)
        return self._render(request.input)

    def _render(self, text: str) -> Media:
        media_type = base_type(self.spec.media_type)
        if media_type in WAV_TYPES:
            return Media(synthesize_wav(text), "audio/wav")
        if media_type in PNG_TYPES:
            return Media(render_png(text), "image/png")
        # A stage this generator has no renderer for (say video) still gets stable bytes.
        return Media(hashlib.sha256(text.encode("utf-8")).digest() * 32, OCTET_STREAM)

    @staticmethod
    def _check_stop(should_stop: Callable[[], bool], request: GenerationRequest) -> None:
        if should_stop():
            raise GenerationStopped(f"generation stopped for scene {request.scene_id} stage {request.stage}")

    def _sleep(self, seconds: float, should_stop: Callable[[], bool], request: GenerationRequest) -> None:
        """Sleep in short slices so a cancel or a lost lease stops the job promptly."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(SLICE_SECONDS, left))
            self._check_stop(should_stop, request)


KNOBS = ("steps", "step_seconds", "fail_rate")


def _knobs(params: Mapping[str, Any]) -> tuple[int, float, float]:
    """(steps, step_seconds, fail_rate); a bad one, or a param of another name, is a GeneratorError naming it.
    *Why the name:* `step_secondz` ran every job at the default, nothing said, as no stage setting may."""
    unknown = sorted(str(name) for name in params if name not in KNOBS)
    if unknown:
        raise GeneratorError(
            f"builtin generator: unknown param(s) {', '.join(map(repr, unknown))}; it takes {', '.join(KNOBS)}",
            misconfigured=True,
        )
    steps = int(number_param(params, "steps", 4, minimum=1, maximum=100_000, integer=True))
    step_seconds = number_param(params, "step_seconds", 0.0, minimum=0.0, maximum=3600.0)
    return steps, step_seconds, number_param(params, "fail_rate", 0.0, minimum=0.0, maximum=1.0)
