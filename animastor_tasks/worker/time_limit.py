"""Celery's soft time limit, told to the flows as what it means for a job: its backend did not answer in time.

The limit fires inside whatever the job's process is doing, almost always a generator waiting on its backend,
as Celery's own `SoftTimeLimitExceeded`. The flows import no Celery, so unnamed it would count as a generator
bug: the pair failed and the queue's breaker heard nothing, however many pairs a hung backend timed out.
Raised from a generator, it becomes a retryable `GeneratorError`: a backend failure, which feeds the breaker
(no retry is tried, as none fits in the job's time any more: `domain.job_rules.another_attempt_fits`).
Raised from the artifact store (an upload that hangs), it becomes the store's `ArtifactStoreError`, marked
`timed_out`: a backend failure too, saying which store did not answer. Unanswered, the task ended in Celery's
exception with the pair `generating`, and each takeover's run counted as a start lost to a dead worker.
Once the generator has returned, the limit has done its work: while the job writes its verdict (which waits out a
Postgres outage) it is held back (`soft_limit_held`), and the hard limit still ends a job that hangs there.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from billiard.pool import SIG_SOFT_TIMEOUT, soft_timeout_sighandler
from celery.exceptions import SoftTimeLimitExceeded

from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.errors import ArtifactStoreError, GeneratorError
from animastor_tasks.ports import ArtifactStore, GenerationRequest, Generator, Generators, Media

log = logging.getLogger("animastor.generate")


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
            raise self._timed_out() from err

    def probe(self) -> None:
        try:
            self.inner.probe()
        except SoftTimeLimitExceeded as err:
            raise self._timed_out() from err

    def _timed_out(self) -> ArtifactStoreError:
        what = f"no answer within the job's soft time limit ({self.soft_time_limit:g} s)"
        return ArtifactStoreError(self.inner.url, what, timed_out=True)


@contextmanager
def soft_limit_held(what: str) -> Iterator[None]:
    """A soft time limit that fires inside is noted, not raised: a finished job's commit waiting for Postgres was
    cut short, its GPU work thrown away and the scene run again from the start. Only where the limit is Celery's
    signal to this process (a prefork pool child, on its main thread); elsewhere there is nothing to hold back."""
    held = (
        SIG_SOFT_TIMEOUT is not None
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(SIG_SOFT_TIMEOUT) is soft_timeout_sighandler
    )
    if not held:
        yield
        return
    fired: list[bool] = []
    signal.signal(SIG_SOFT_TIMEOUT, lambda *_: fired.append(True))
    try:
        yield
    finally:
        signal.signal(SIG_SOFT_TIMEOUT, soft_timeout_sighandler)
        if fired:
            log.warning("[GENERATE] %s soft time limit passed while its verdict was written; not cut short", what)
