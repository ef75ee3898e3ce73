"""The records that cross the seams (`ports.py`): plain values a port hands a flow or takes from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from animastor_tasks.domain.resend import FirstSending
from animastor_tasks.domain.types import Pair, SceneKey


@dataclass(frozen=True)
class CommandContext:
    """What a regenerate must know before it writes anything."""

    exists: bool
    scenes: list[SceneKey]  # the named scenes that exist, or every scene, in reading order
    layers_raw: str | None
    replay_of: list[str]  # commands already created for this request id
    first_sending: FirstSending | None = None  # what they were made from (with replay_of)


@dataclass(frozen=True)
class CommandRow:
    command_id: str
    book_id: str
    stage: str
    status: str
    reason: str | None
    targets: int
    created_at: float
    progress: dict[str, int] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=dict)  # targets released to dirty, by reason


@dataclass(frozen=True)
class NewCommands:
    """What `create_commands` wrote: the command ids, the generating pairs a forced command fenced off, and a
    whole-book request's targets (the book's scenes as the commands were written)."""

    command_ids: list[str]
    superseded: list[tuple[Pair, str | None]] = field(default_factory=list)  # with the job's dispatch id, to stop
    targets: list[SceneKey] | None = None  # None: the scenes named


class InFlight(NamedTuple):
    """A pending or generating pair as a gate pass sees it; a named tuple (0.5 µs to build, a dataclass 2.0)."""

    chapter: str
    scene: str
    stage: str
    state: str
    token: int
    position: int
    dispatch_id: str | None
    ready_hash: str | None  # hash of the inputs of the last committed artifact
    current_hash: str | None  # hash of the scene's current inputs
    has_artifact: bool
    commanded: bool  # an active command of this stage targets the scene
    rank: int  # `priority_rank` of the most urgent active command targeting it (0 first)
    since: float | None  # when the oldest active command targeting it was created
    pair: Pair  # (chapter, scene, stage), made once: a pass over 100k pairs asks for it 800k times


@dataclass(frozen=True)
class GateRows:
    layers_raw: str | None
    tombstone: bool
    commanded: frozenset[Pair]  # in-flight pairs an active command targets
    in_flight: tuple[InFlight, ...]


@dataclass(frozen=True)
class Claim:
    """A pair moved pending -> generating under a new token and dispatch id."""

    chapter: str
    scene: str
    stage: str
    token: int
    dispatch_id: str

    @property
    def pair(self) -> Pair:
        return (self.chapter, self.scene, self.stage)


@dataclass(frozen=True)
class Committed:
    """A job's verdict, in (its commit, its failure or its give-back): what its book has left of the job's stage, read
    in the same transaction. `pending`: the rank of its most urgent pending pair that an authorizing command targets
    (`priority_rank`); None: none. `outdated`: a commit that landed `dirty`, its media made from an input a
    re-import replaced while it ran."""

    pending: int | None
    outdated: bool = False


@dataclass(frozen=True)
class DuePasses:
    """What a tick takes in one step: the books due, those whose held pass lapsed (its holder's process died,
    flow/pass_hold.py), and how many passes in a row each book still counts lost (the lapsed ones' counted up)."""

    due: list[str]
    lapsed: list[str]
    lapses: dict[str, int]


@dataclass(frozen=True)
class RunRecorded:
    """What a job's run told its queue's breaker (`Breaker.breaker_record_run`). `state`: the breaker's answer
    ('closed', 'open', 'reopened', 'recovered' or 'host'; None: nothing to record, or Redis did not answer).
    `streak`: the failed runs in a row of the run's node, this one counted, whatever the state (0: ended by this
    success, or not counted on a node)."""

    state: str | None
    streak: int = 0


@dataclass(frozen=True)
class GeneratingRow:
    book: str
    chapter: str
    scene: str
    stage: str
    token: int
    dispatch_id: str | None
    # How long before the read its dispatch's start, open in Postgres, was made: an age, by Postgres's clock alone.
    # *Why not the time:* compared with a time of Redis's clock, it was off by the two servers' clocks' difference.
    started_ago: float | None = None

    @property
    def started(self) -> bool:
        """A job ran its dispatch, and has not ended."""
        return self.started_ago is not None

    @property
    def pair(self) -> Pair:
        return (self.chapter, self.scene, self.stage)


@dataclass(frozen=True)
class JobRow:
    """A pair's row as a starting job reads it (under its row lock)."""

    state: str
    token: int
    owner: str | None  # the dispatch id the pair is generating for
    text: str
    prompt: str
    tombstone: bool
    commanded: bool  # an active command of the stage targets the scene
    layers_raw: str | None
    open_start: str | None = None  # the dispatch whose start of this pair never ended (its worker died?)
    lost_starts: int = 0  # worker-lost starts in a row before that one
    input_hash: str | None = None  # the scene's input hash for the stage: what the job's media is made from
    open_start_shut_down: bool = False  # that start's worker was told to shut down while it ran (0011)


@dataclass(frozen=True)
class Snapshot:
    """Everything Redis knows that a gate pass needs, read in one round trip."""

    cancel_flag: bool
    force: set[Pair]
    deferred: dict[str, set[Pair]]  # live deferrals by bucket
    active: set[SceneKey]  # the book's scenes in the active index
    consumers: dict[str, int]  # live heartbeats per queue asked for
    breaker_clean: dict[str, bool]  # no failure recorded: publishing needs no breaker call
    data_lost_at: float = float("-inf")  # when Redis lost its data (-inf: never): the force set with it
    presence_unsure_since: float = float("-inf")  # data lost or back from an outage: no consumer proves nothing yet
    # Per queue asked for: the head of its waiting list, book -> the priority rank it waits at, first first.
    waiters: dict[str, dict[str, int]] = field(default_factory=dict)
    # The same books, each with the time its place says it waits since (`domain.deferral.wait_score`; a book served
    # moments ago waits from `SERVED_AFTER` on): who waited longer than whom at one priority.
    places: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per queue asked for: the books handed a slot of it moments ago whose refills have not claimed it yet, book ->
    # the priority rank they were handed it at (off the waiting list meanwhile).
    handed: dict[str, dict[str, int]] = field(default_factory=dict)
    first_deferral_end: float | None = None  # when the book's earliest live deferral ends (None: none live)
    due_at: float | None = None  # when the due index asks for the book's next pass (None: it does not)


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
