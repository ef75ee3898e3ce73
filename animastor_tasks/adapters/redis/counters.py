"""Counters and duration histograms the flows leave for the metrics exporter.

They live in one Redis hash so every worker process adds to the same totals and the
exporter (`animastor-tasks metrics`) reads them with one HGETALL. Losing them in a Redis
restart only resets counters, which Prometheus handles as a counter reset. Updates are
best effort: a lost one never fails the work that made it.

A process holds its updates in memory and a writer thread adds them to the hash in one round trip every
`FLUSH_SECONDS` (and when the process closes its stores or its worker shuts down): a job made seven
counter round trips of its own and a regenerate two. What a killed process still held is lost.

Each flush is applied at most once: its updates go as one batch under an id, which `lua/add_counters.lua`
applies only if it has not already done so. Redis failing, the batch's outcome is unknown (a timeout may
come after Redis applied it), so it is kept as it is and sent again under the same id at the next flush,
where a batch already applied adds nothing; updates made meanwhile go in a batch of their own. The mark of
an applied batch lasts `BATCH_MARKER_SECONDS`: only a batch whose reply was lost and that could not be sent
again for that long (Redis out of reach all the while) may be added twice.

Names carry their labels after a colon: `job:<event>:<stage>`, `dispatch:<outcome>`, and histograms
`<name>:<stage>` (`job_seconds:audio`), which the exporter turns into a `stage` label.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain

import redis

from animastor_tasks.adapters.redis.connection import RedisConnection, _script

log = logging.getLogger("animastor.telemetry")

#: Upper bounds (seconds) of the duration histograms; everything above the last lands in "+Inf". Up to a
#: minute: a reconcile pass may run until its lock lapses (0.8 x its 30 s period), and a p99 in "+Inf" read 10 s.
DURATION_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Bounds of the GPU-side histograms (a job or its wait in the queue takes seconds to half an hour).
JOB_BUCKETS: tuple[float, ...] = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: Histograms (name before any `:<stage>`) that use `JOB_BUCKETS`.
LONG_HISTOGRAMS = frozenset({"job_seconds", "queue_wait_seconds"})
FLUSH_SECONDS = 0.5  # a scrape sees an update at most this much later
#: How long Redis remembers that a batch was applied: how late a batch whose reply was lost may be sent again.
BATCH_MARKER_SECONDS = 300
_stores: weakref.WeakSet[CounterStore] = weakref.WeakSet()  # this process's stores, for `flush_all`


def buckets_for(name: str) -> tuple[float, ...]:
    """The bucket bounds of histogram `name` (`job_seconds:audio` uses those of `job_seconds`)."""
    return JOB_BUCKETS if name.partition(":")[0] in LONG_HISTOGRAMS else DURATION_BUCKETS


def histogram_field(name: str, part: str) -> str:
    """The counters-hash field of one histogram part: `le=<bound>`, `count`, `sum_us` or `last`."""
    return f"hist:{name}:{part}"


@dataclass(frozen=True)
class _Batch:
    """Updates flushed together under one id: sent again as they are, never merged with newer ones, so a
    batch Redis applied already is recognised by its id."""

    id: str
    increments: Counter[str]
    latest: dict[str, str]


class CounterStore:
    def __init__(self, conn: RedisConnection, flush_seconds: float = FLUSH_SECONDS) -> None:
        self.conn = conn
        self.flush_seconds = flush_seconds
        self._add_batch = conn.client.register_script(_script("add_counters"))
        self._closed = threading.Event()
        self._start_empty()
        _stores.add(self)

    def _start_empty(self) -> None:
        """Nothing held and no writer yet: a new store, or its copy in a forked child (the parent writes
        out what it held; the child's writer is started by its first update)."""
        self._lock = threading.Lock()
        self._increments: Counter[str] = Counter()
        self._latest: dict[str, str] = {}
        self._writing = False
        self._flushing = threading.Lock()  # one flush at a time: the unsent batch is sent by one only
        self._unsent: _Batch | None = None  # a batch whose flush failed, maybe after Redis applied it

    def add(self, counts: Mapping[str, int]) -> None:
        with self._holding() as (increments, _):
            for name, n in counts.items():
                if n:
                    increments[name] += n

    def observe(self, name: str, seconds: float) -> None:
        """Add one duration to the histogram `name`: its bucket, count, sum and time of last.

        Buckets are stored non-cumulative and the sum in whole microseconds (HINCRBY stays an
        integer); the exporter accumulates them (`operator/metrics.py`).
        """
        bound = next((f"{b:g}" for b in buckets_for(name) if seconds <= b), "+Inf")
        with self._holding() as (increments, latest):
            increments[histogram_field(name, f"le={bound}")] += 1
            increments[histogram_field(name, "count")] += 1
            increments[histogram_field(name, "sum_us")] += max(0, round(seconds * 1_000_000))
            latest[histogram_field(name, "last")] = f"{self.conn.server_time_as_known():.3f}"  # read on other hosts

    @contextmanager
    def _holding(self) -> Iterator[tuple[Counter[str], dict[str, str]]]:
        with self._lock:
            if not self._writing:
                self._writing = True
                threading.Thread(target=self._write_every, name="animastor-counters", daemon=True).start()
            yield self._increments, self._latest

    def _write_every(self) -> None:
        while not self._closed.wait(self.flush_seconds):
            self.flush()

    def flush(self) -> None:
        """Add what this process holds to the hash: first the batch an earlier flush failed to send, as it was,
        then what was held since, as a batch of its own. A batch that fails is kept for the next flush."""
        with self._flushing:
            retrying = self._unsent is not None
            if self._send() and retrying:
                self._send()

    def _send(self) -> bool:
        """Send the unsent batch, else one made of what is held, in one round trip; False when Redis failed.

        The failed batch is kept whole under its id: Redis may have applied it before the error, and the
        script applies a batch id at most once."""
        batch = self._unsent or self._take_held()
        if batch is None:
            return True
        keys = [self.conn.keys.metrics(), self.conn.keys.counter_batch(batch.id)]
        args: list[str | int] = [BATCH_MARKER_SECONDS, len(batch.increments)]
        args += chain.from_iterable(batch.increments.items())
        args += chain.from_iterable(batch.latest.items())
        try:
            self._add_batch(keys=keys, args=args, client=self.conn.client)  # the connection's client of the moment
        except redis.RedisError as err:
            log.debug("[METRICS] %d counter update(s) kept for the next flush: %s", len(batch.increments), err)
            self._unsent = batch
            return False
        self._unsent = None
        return True

    def _take_held(self) -> _Batch | None:
        with self._lock:
            if not self._increments and not self._latest:
                return None
            batch = _Batch(uuid.uuid4().hex, self._increments, self._latest)
            self._increments, self._latest = Counter(), {}
        return batch

    def close(self) -> None:
        self._closed.set()
        self.flush()

    def read(self) -> dict[str, str]:
        """Every counter and histogram field (for the exporter), this process's own held ones first added;
        `StoreUnavailable` when Redis is down."""
        self.flush()
        raw = self.conn.run(lambda: self.conn.client.hgetall(self.conn.keys.metrics()))
        return {str(k): str(v) for k, v in raw.items()}


def add_now(conn: RedisConnection, counts: Mapping[str, int]) -> None:
    """Add `counts` to the hash at once, in one round trip, with no store or writer thread: for the rare count
    of a process that keeps none (a worker's main process, before and between its pool's forks)."""
    with conn.errors():
        pipe = conn.client.pipeline(transaction=False)
        for name, n in counts.items():
            pipe.hincrby(conn.keys.metrics(), name, n)
        pipe.execute()


def flush_all(**_: object) -> None:
    """What this process holds goes out before it leaves: at exit, and on `worker_process_shutdown` (a prefork
    child leaves by `os._exit`, past any atexit hook)."""
    for store in list(_stores):
        store.flush()


def _forget_in_child() -> None:
    for store in list(_stores):
        store._start_empty()


atexit.register(flush_all)
os.register_at_fork(after_in_child=_forget_in_child)
