"""The seams between the flows and the outside world: one Protocol per I/O role (the records crossing them: records.py).

The flows (`flow/`) see only these; Postgres, Redis, Celery, the broker, the artifact store and the generators
live behind them in `adapters/` and `generators/`, and `worker/wiring.py` builds the real ones once per process.
A port method does one thing a flow needs; it never hands out a driver's client.
"""

from __future__ import annotations

import collections.abc
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from animastor_tasks.config import Settings
from animastor_tasks.domain.capacity import CapacityCounts
from animastor_tasks.domain.registry import StageSpec
from animastor_tasks.domain.types import BookPair, Pair, SceneKey
from animastor_tasks.domain.vocabulary import AssetState, Priority
from animastor_tasks.records import (  # re-exported: the flows and adapters import them from here
    Claim,
    CommandContext,
    CommandRow,
    Committed,
    DuePasses,
    GateRows,
    GeneratingRow,
    GenerationRequest,
    JobRow,
    Media,
    NewCommands,
    RunRecorded,
    Snapshot,
)

# -- Postgres: the durable truth ----------------------------------------------------------


class Catalog(Protocol):
    def command_context(self, book_id: str, named: list[SceneKey] | None, request_id: str) -> CommandContext: ...
    def book_exists(self, book_id: str) -> bool: ...
    def layers(self, book_id: str) -> str | None: ...
    def change_layers(  # the new config and the pending pairs of the stages turned off, released to dirty
        self, book_id: str, changes: Mapping[str, bool]
    ) -> tuple[str, list[Pair]] | None: ...


class Commands(Protocol):
    def create_commands(
        self,
        book: str,
        request_id: str,
        per_stage: dict[str, tuple[str, list[SceneKey]]],
        force: bool,
        priority: Priority = Priority.NORMAL,
        asked: tuple[Sequence[str], bool] | None = None,  # the request's stages and whether it named no scenes
    ) -> NewCommands: ...
    def command_statuses(self, command_ids: Sequence[str]) -> dict[str, str]: ...
    def commands(
        self,
        *,
        book: str | None = None,
        command_ids: Sequence[str] | None = None,
        limit: int = 200,
        every_active: bool = False,
    ) -> list[CommandRow]: ...
    def block_stage(self, book: str, stage: str, reason: str) -> tuple[list[str], list[tuple[Pair, str | None]]]: ...
    def cancel_book(self, book: str, reason: str | None) -> tuple[list[str], int, list[tuple[Pair, str]]]: ...
    def forced_in_flight(self, book: str, force_ttl: float, pairs: Sequence[Pair]) -> list[tuple[Pair, float]]: ...
    def tombstoned_books(self) -> list[str]: ...
    def is_tombstoned(self, book: str) -> bool: ...
    def books_with_work(self) -> dict[str, int]: ...  # book -> its pairs in flight
    def prune_commands(self, retention_days: float, targets: int) -> int: ...


class ClaimSession(Protocol):
    """An open claim transaction: the lane and book locks are held until it ends."""

    counts: CapacityCounts

    def claim(self, chosen: Sequence[tuple[Pair, str]]) -> list[Claim]: ...


class Assets(Protocol):
    def gate_rows(self, book: str, pairs: Sequence[Pair] | None = None) -> GateRows | None: ...
    def gate_rows_many(self, books: Sequence[str], limit: int | None = None) -> dict[str, GateRows | None] | None: ...
    def gate_row_pages(self, book: str, size: int) -> collections.abc.Generator[GateRows, None, None]: ...
    def gate_candidates(self, book: str, stages: Sequence[str], limit: int) -> GateRows | None: ...
    def in_flight_scene_pages(self, books: Sequence[str], size: int) -> Iterator[dict[str, list[SceneKey]]]: ...
    def in_flight_scene_count(self, book: str) -> int: ...
    def scenes_in_flight(self, book: str, scenes: Sequence[SceneKey]) -> set[SceneKey]: ...
    def release_denied(  # pending -> dirty, judged anew; `stop_stands` asked if no tombstone (the caller saw a flag)
        self, book: str, pairs: Sequence[Pair], stop_stands: Callable[[], bool] | None = None
    ) -> list[Pair]: ...
    def claiming(
        self,
        book: str,
        lanes: Mapping[str, str],
        waiters: Mapping[str, Mapping[str, int]] | None = None,
        handed: Mapping[str, Mapping[str, int]] | None = None,
        ahead: Mapping[str, Collection[str]] | None = None,
    ) -> AbstractContextManager[ClaimSession]: ...
    def lane_load(self, stages: Sequence[str]) -> dict[str, int]: ...
    def unclaim(self, book: str, claims: Sequence[Claim]) -> int: ...
    def mark_already_completed(self, book: str, pairs: Sequence[Pair]) -> list[Pair]: ...
    def generating_pairs(self, book: str | None = None) -> list[GeneratingRow]: ...  # of `book` alone, if named
    def dispatch_ids(self, pairs: Sequence[BookPair]) -> dict[BookPair, str | None]: ...  # rows that exist
    def expire_generating(  # `still_lapsed` asked under the pair's row lock, after the update: False undoes it
        self,
        book: str,
        pair: Pair,
        token: int,
        target: AssetState,
        still_lapsed: Callable[[], bool],
        *,
        stop_stands: Callable[[], bool] | None = None,  # as for `release_denied`, for a `dirty` judged again
    ) -> AssetState | None: ...  # the state written (`dirty` may be judged `pending` again), None: none
    def scene_states(self, book: str) -> list[tuple[str, str, str, str, str | None]]: ...
    def artifact_uris(self, book: str) -> dict[Pair, str]: ...  # committed artifacts' file:// or s3:// URIs
    def pair_errors(self, book: str) -> dict[Pair, str]: ...  # why each failed pair failed


class JobStart(Protocol):
    """An open job-start transaction holding the pair's row lock."""

    row: JobRow | None

    def record_start(self, token: int, dispatch_id: str, lost_starts: int) -> None: ...


class Jobs(Protocol):
    def starting(self, book: str, pair: Pair) -> AbstractContextManager[JobStart]: ...
    def answers(self) -> bool: ...  # Postgres answers this process now
    def commit_job(  # None: its token was stale, nothing written
        self, book: str, pair: Pair, token: int, dispatch_id: str, artifact: dict[str, Any], lane: str
    ) -> Committed | None: ...
    def fail_job(  # None: its token was stale, nothing written
        self, book: str, pair: Pair, token: int, dispatch_id: str, error: str, lane: str
    ) -> Committed | None: ...
    def give_back(  # None: its token was stale, nothing written; `released`: to dirty, its targets released; `ran`:
        self,  # False for a job refused at its start check (it never started)
        book: str,
        pair: Pair,
        token: int,
        dispatch_id: str,
        reason: str,
        lane: str,
        *,
        released: bool = False,
        ran: bool = True,
    ) -> Committed | None: ...
    def end_start(self, book: str, pair: Pair, dispatch_id: str) -> None: ...
    def token_is_current(  # `locking`: waits for a takeover changing the row (`expire_generating`)
        self, book: str, pair: Pair, token: int, dispatch_id: str, *, locking: bool = False
    ) -> bool: ...


class Journal(Protocol):
    def prune_journal(self, retention_days: float, max_rows: int) -> int: ...
    def prune_artifacts(self, retention_days: float, after: int, rows: int) -> tuple[int, int]: ...  # (pruned, next)


# -- Redis: coordination, rebuildable from Postgres ---------------------------------------


# The cancel flag a regenerate lifted: a Stop All's own ("stop": it alone stops the book), one mirroring a tombstone
# ("mirror"), or none.
LiftedFlag = Literal["stop", "mirror"] | None


class BookState(Protocol):
    """Cancel flags, the force set and the active index."""

    def book_snapshots(self, books: Sequence[str], now: float, queues: Sequence[str] = ()) -> dict[str, Snapshot]: ...
    def pair_snapshot(self, book: str, pairs: Sequence[Pair], now: float, queues: Sequence[str]) -> Snapshot: ...
    def set_due(self, book: str, when: float) -> None: ...  # an earlier entry stands
    def ask_pass(self, book: str, seconds: float) -> bool: ...  # none asked in the last `seconds`: this one is
    def set_due_all(self, books: Sequence[str], when: float) -> None: ...  # `set_due` of each, one round trip
    def clear_due(self, book: str, seen: float) -> None: ...  # only while the entry is still `seen`
    def take_due(self, now: float) -> DuePasses: ...  # and the lapsed holds, in one step
    def hold_passes(self, holder: str, books: Sequence[str], until: float) -> None: ...  # flow/pass_hold.py
    def renew_passes(  # how many of `held` had lapsed; `passed`: their lost passes forgotten
        self, holder: str, held: Sequence[str], until: float, *, ended: Sequence[str] = (), passed: Sequence[str] = ()
    ) -> int: ...
    def let_go_passes(self, holder: str, books: Sequence[str], *, passed: Sequence[str] = ()) -> None: ...
    def presence_unsure_since(self, now: float | None = None) -> float: ...
    def server_started_at(self) -> float: ...  # when the Redis server started (-inf: it does not say)
    def cancel_flag_set(self, book: str) -> bool: ...
    def clear_mirror_flag(self, book: str) -> None: ...  # only a flag that mirrors a tombstone
    def clear_stop_flag(self, book: str) -> None: ...  # only a Stop All's own (of a book Postgres does not hold)
    def lift_cancel_flag(self, book: str, request: str, now: float) -> LiftedFlag: ...  # a regenerate's
    def end_lift(self, book: str, request: str, put_back: LiftedFlag = None) -> None: ...  # a refused regenerate's
    def stop_stands(self, book: str, now: float) -> bool: ...  # a Stop All's own flag, no regenerate lifting it
    def set_cancel_flags(self, books: Iterable[str]) -> None: ...  # mirrors of tombstones, never over a Stop All's
    def stop_book(self, book: str, queues: Sequence[str] = (), sent_at: float | None = None) -> None: ...  # off lanes
    def void_if_stopped(self, book: str, request: str, sent_at: float | None) -> bool: ...  # sent before a Stop All
    def start_work(  # `snapshot` (now, queues): the book's snapshot, read after the writes in the same round trip
        self,
        book: str,
        pairs: Sequence[Pair],
        scenes: Sequence[SceneKey],
        *,
        force_ttl: int | None,
        snapshot: tuple[float, Sequence[str]] | None = None,
        most_scenes: int | None = None,
        lifted: str | None = None,  # the request whose lift (`lift_cancel_flag`) these writes end
        hold: tuple[str, float] | None = None,  # (holder, until): the book's first pass held (`hold_passes`)
    ) -> Snapshot | None: ...
    def activate(self, scenes_of: Mapping[str, Iterable[SceneKey]]) -> None: ...
    def deactivate(self, book: str, scenes: Iterable[SceneKey]) -> None: ...
    def active_scene_count(self, book: str) -> int: ...
    def scan_active(self, book: str, count: int) -> Iterator[list[SceneKey]]: ...
    def drop_book_if_idle(self, book: str) -> None: ...
    def active_books(self) -> set[str]: ...


class Deferrals(Protocol):
    def defer(self, book: str, bucket: str, pairs: Iterable[Pair], seconds: float, now: float) -> None: ...
    def clear_deferrals(self, book: str, pairs: Iterable[Pair]) -> None: ...
    def prune_deferrals(self, books: Iterable[str], now: float) -> None: ...
    def wait_for_lane(  # `job_lasts` (a refusal's): how long a served place stands against it
        self, queue: str, book: str, score: float, *, served: bool = False, job_lasts: float = 0.0
    ) -> None: ...
    def next_waiters(  # `ended`: the dispatch id of the job that freed the slot, and what its end left its book
        self,
        queue: str,
        count: int,
        *,
        exclude: str | None = None,
        ended: tuple[str, Committed] | None = None,
    ) -> list[str]: ...
    def stranded_lanes(self, free: Sequence[str], min_age: float) -> list[str]: ...  # free with waiters, for a while
    def hand_over_done(self, queue: str, book: str, began: float) -> None: ...  # its refill, begun then, is done
    def hand_over_again(self, queue: str, book: str, at: float, score: float) -> None: ...  # a claim undone: noted
    def keep_handed_place(self, queue: str, book: str) -> None: ...  # at the head of the priority it was handed with
    def restore_lost_hand_overs(  # (queue, book) handed at least min_age ago, refill lost: back on the list
        self, queues: Sequence[str], min_age: float
    ) -> list[tuple[str, str]]: ...
    def open_hand_over(self, books: int) -> str: ...  # an id for slots handed to several books at once
    def close_hand_over(self, batch: str) -> bool: ...  # True: this was the last of the books
    def leave_lanes(self, book: str, queues: Sequence[str]) -> None: ...  # off these lanes' waiting lists


class Leases(Protocol):
    def take_leases(self, leases: Sequence[tuple[BookPair, str, int, dict[str, Any]]]) -> None: ...
    def lease_holders(self, pairs: Sequence[BookPair]) -> list[str | None]: ...
    # A running job's watcher, each poll, in one round trip: its pair's lease holder, and its book's cancel flag.
    def watch(self, pair: BookPair, book: str) -> tuple[str | None, bool]: ...
    def lease_seconds_left(self, pairs: Sequence[BookPair]) -> list[float | None]: ...  # None: no lease
    def undelivered(self, dispatch_ids: Sequence[str]) -> list[float | None]: ...
    def restore_leases(self, leases: Sequence[tuple[BookPair, str, int, float]]) -> set[str]: ...
    def renew_lease(self, pair: BookPair, dispatch_id: str, ttl: float) -> bool: ...
    def release_lease(self, pair: BookPair, dispatch_id: str) -> None: ...  # only while that dispatch holds it
    def release_leases(self, leases: Sequence[tuple[BookPair, str]]) -> None: ...  # as release_lease, batched
    def supersede(  # running told to stop, queued withdrawn; each remembered `remembered` seconds
        self, jobs: Sequence[tuple[BookPair, str, int]], remembered: int
    ) -> int: ...
    def superseded(self, dispatch_ids: Sequence[str]) -> list[bool]: ...
    def start_delivery(  # (lease held, delivery owned, book cancelled, when the dispatch was published or None)
        self, pair: BookPair, dispatch_id: str, worker: str, ttl: int
    ) -> tuple[bool, bool, bool, float | None]: ...
    def retake_lease(self, pair: BookPair, dispatch_id: str, worker: str, ttl: int) -> bool: ...  # while none holds it
    def touch_delivery(self, dispatch_id: str, ttl: int) -> None: ...
    def delivery_holders(self, dispatch_ids: Sequence[str]) -> list[str | None]: ...  # `<node>#<pid>` running each
    def held_jobs(self, nodes: Sequence[str]) -> list[tuple[BookPair, str]]: ...  # running, holding their lease
    def abandon_delivery(  # (its dispatch id, its stage, whether its lease went too), None when it held none
        self, holder: str, redelivered: str | None
    ) -> tuple[str, str, bool] | None: ...
    def end_delivery(self, dispatch_id: str) -> None: ...
    def batched(self) -> AbstractContextManager[None]: ...  # this thread's writes in the block: one round trip


class Breaker(Protocol):
    def breaker_acquire(self, queue: str, permit_seconds: float) -> str: ...
    def breaker_record(  # a publish's result: 'closed', 'open', 'reopened' or 'recovered'
        self, queue: str, ok: bool, threshold: int, cooldown: float
    ) -> str: ...
    def breaker_record_run(
        self, queue: str, ok: bool, threshold: int, cooldown: float, node: str | None
    ) -> RunRecorded: ...  # and `node`'s streak (None: not counted on it); 'host': it fails while others succeed
    def breaker_release(self, queue: str) -> bool: ...
    def breaker_refuses_until(self, queue: str) -> float: ...  # when an open breaker may test its lane


class Presence(Protocol):
    """Live consumers per queue: worker heartbeats, and the broker's own count where it has one."""

    def counts(self, queues: Sequence[str], heartbeats: dict[str, int] | None = None) -> dict[str, int]: ...
    def last_beats(self, nodes: Sequence[str]) -> dict[str, float]: ...  # node -> its last heartbeat, if on record
    def live_consumers(  # queue -> {node: heartbeat expiry} of those whose heartbeat is live (Redis server's clock)
        self, queues: Sequence[str], now: float | None = None
    ) -> dict[str, dict[str, float]]: ...
    def nodes(self) -> list[str]: ...  # every worker node whose last heartbeat is on record
    def departed_ago(self, queues: Sequence[str]) -> dict[str, float]: ...  # queue -> since its consumer's clean stop
    def held(self, queues: Sequence[str]) -> set[str]: ...  # those a live worker beats for with no consumer on them
    def unconsumed_seen(self, queues: Sequence[str]) -> dict[str, float]: ...  # queue -> last double count of none
    def note_unconsumed(self, queues: Sequence[str]) -> None: ...  # a double count found none on these, now
    def await_consumer(self, queues: Sequence[str]) -> None: ...  # a pass waits for a worker on these


class Counters(Protocol):
    """Best-effort totals for the metrics exporter; a lost update never fails the work."""

    def add(self, counts: Mapping[str, int]) -> None: ...
    def observe(self, name: str, seconds: float) -> None: ...


class Locks(Protocol):
    def try_lock(self, name: str, seconds: float) -> bool: ...
    def bookmark(self, name: str) -> str | None: ...  # None: never set, or lost with Redis's data
    def set_bookmark(self, name: str, value: str, *, kept: bool = False) -> None: ...  # kept: only over one there


# -- the broker, the artifact store, the generators ---------------------------------------


class Publisher(Protocol):
    def publish_job(self, task_name: str, queue: str, dispatch_id: str, kwargs: dict[str, Any]) -> None: ...
    def revoke(self, dispatch_ids: Sequence[str]) -> None: ...
    def fail_lost(self, node: str, dispatch_ids: Sequence[str], why: str) -> None: ...  # for Flower; never raises
    def enqueue_refill(  # `slots`: how many free slots of `lane` it is handed (None: as many as it finds), `batch`:
        self,  # the hand-over it is one of (`Deferrals.open_hand_over`)
        book_id: str,
        lane: str | None = None,
        freed: str | None = None,
        slots: int | None = None,
        batch: str | None = None,
    ) -> None: ...
    def enqueue_gates(self, book_ids: Sequence[str]) -> None: ...  # one task passing several books in turn


class QueueProbe(Protocol):  # what the broker holds; None where it cannot tell
    def queued_dispatch_ids(self, queues: Collection[str]) -> set[str] | None: ...  # jobs still waiting in the queues
    def queue_depths(self, queues: Collection[str]) -> dict[str, int] | None: ...  # ready messages, not taken yet
    def waiting(self, queue: str) -> int | None: ...  # messages waiting in one queue, on either broker


class ArtifactStore(Protocol):
    @property
    def url(self) -> str: ...  # where the store is, for messages

    def put(self, data: bytes, media_type: str) -> dict[str, Any]:
        """Store content-addressed bytes once; the record (sha256, size, media_type, path, uri) a commit keeps."""

    def probe(self) -> None:
        """Store something small, whatever is there (`ArtifactStoreError` if the store will not take it)."""


@runtime_checkable
class Generator(Protocol):
    """A backend that turns one request into media.

    `should_stop()` must be polled often; when it answers True the generator raises `GenerationStopped`
    and produces nothing. `progress(fraction)` reports 0..1. Failures are `GeneratorError(message, retryable=...)`.
    """

    name: str

    def generate(
        self, request: GenerationRequest, should_stop: Callable[[], bool], progress: Callable[[float], None]
    ) -> Media: ...


class Generators(Protocol):
    def load(self, spec: StageSpec) -> Generator: ...


@dataclass(frozen=True)
class Ports:
    """The ports one process's flows work through, built by `worker.wiring`."""

    settings: Settings
    catalog: Catalog
    commands: Commands
    assets: Assets
    jobs: Jobs
    journal: Journal
    book_state: BookState
    deferrals: Deferrals
    leases: Leases
    breaker: Breaker
    presence: Presence
    counters: Counters
    locks: Locks
    publisher: Publisher
    queue_probe: QueueProbe
    artifacts: ArtifactStore
    generators: Generators
    clock: Callable[[], float] = time.time  # now, for times other hosts read; wiring: the Redis server's clock
