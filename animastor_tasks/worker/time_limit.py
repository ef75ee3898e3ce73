"""Celery's soft time limit, told to the flows as what it means for a job: its backend did not answer in time.

The limit fires inside whatever the job's process is doing, almost always a generator waiting on its backend,
as Celery's own `SoftTimeLimitExceeded`. The flows import no Celery, so unnamed it would count as a generator
bug: the pair failed and the queue's breaker heard nothing, however many pairs a hung backend timed out.
Raised from a generator, it becomes a retryable `GeneratorError`: a backend failure, which feeds the breaker
(no retry is tried, as none fits in the job's time any more: `domain.job_rules.another_attempt_fits`).
Raised from the artifact store (an upload that hangs), it becomes the store's `ArtifactStoreError`: the pair fails
saying which store did not answer. Unanswered, the task ended in Celery's exception with the pair `generating`, and
each takeover's run counted as a start lost to a dead worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.errors import ArtifactStoreError, GeneratorError
from animastor_tasks.ports import ArtifactStore, GenerationRequest, Generator, Generators, Media


class TimeLimitedGenerators:
    """The flows' `Generators`, each generator it loads answering the soft time limit as a backend failure."""

    def __init__(self, inner: Generators, soft_time_limit: float) -> None:
        self.inner = inner
        self.soft_time_limit = soft_time_limit

    def load(self, spec: StageSpec) -> Generator:
        return _TimeLimited(self.inner.load(spec), self.soft_time_limit)


class _TimeLimited:
    def __init__(self, generator: Generator, soft_time_limit: float) -> None:
        self.generator = generator
        self.name = generator.name
        self.soft_time_limit = soft_time_limit

    def generate(
        self, request: GenerationRequest, should_stop: Callable[[], bool], progress: Callable[[float], None]
    ) -> Media:
        try:
            return self.generator.generate(request, should_stop, progress)
        except SoftTimeLimitExceeded as err:
            raise GeneratorError(
                f"{self.name}: no result within the job's soft time limit ({self.soft_time_limit:g} s)",
                retryable=True,
            ) from err


class TimeLimitedArtifacts:
    """The flows' `ArtifactStore`, answering the soft time limit as the store's failure."""

    def __init__(self, inner: ArtifactStore, soft_time_limit: float) -> None:
        self.inner = inner
        self.soft_time_limit = soft_time_limit

    @property
    def url(self) -> str:
        return self.inner.url

    def put(self, data: bytes, media_type: str) -> dict[str, Any]:
        try:
            return self.inner.put(data, media_type)
        except SoftTimeLimitExceeded as err:
            raise ArtifactStoreError(
                self.inner.url, f"no answer within the job's soft time limit ({self.soft_time_limit:g} s)"
            ) from err
