"""The task contract v1 as Python types: what callers send and get back.

Pure types, no I/O, so a caller can type its code against the contract without pulling in
the runtime. Each TypedDict mirrors one schema under docs/schemas/ (a test keeps their keys equal).
No `from __future__ import annotations` here: on Python 3.11 it hides `NotRequired` from
`__required_keys__`, which callers and that test read.
"""

from typing import Literal, NotRequired, TypedDict

PriorityName = Literal["interactive", "normal", "bulk"]
CommandStatusName = Literal["active", "blocked", "completed", "cancelled", "failed"]
AssetStateName = Literal["dirty", "pending", "generating", "ready", "failed"]


class RegenerateKwargs(TypedDict):
    """docs/schemas/regenerate-kwargs.schema.json"""

    book_id: str
    stages: list[str]
    scenes: NotRequired[list[list[str]] | None]
    command_id: NotRequired[str | None]
    force: NotRequired[bool]
    priority: NotRequired[PriorityName | None]


class CommandCreated(TypedDict):
    command_id: str
    stage: str
    targets: list[list[str]] | int  # the scenes; on a replay only their number
    status: CommandStatusName


class Skipped(TypedDict):
    stage: str
    reason: str


class RegenerateResult(TypedDict):
    """docs/schemas/regenerate-result.schema.json"""

    commands: list[CommandCreated]
    skipped: list[Skipped]
    replayed: NotRequired[Literal[True]]


class CancelKwargs(TypedDict):
    """docs/schemas/cancel-kwargs.schema.json"""

    book_id: str
    reason: NotRequired[str | None]


class CancelResult(TypedDict):
    """docs/schemas/cancel-result.schema.json"""

    book_id: str
    cancelled_commands: list[str]
    released: int
    revoked: int


class GateKwargs(TypedDict):
    """docs/schemas/gate-kwargs.schema.json"""

    book_id: str
    lane: NotRequired[str | None]


class GateResult(TypedDict):
    """docs/schemas/gate-result.schema.json"""

    book_id: str
    authorized: int
    released: int
    outcomes: dict[str, int]
    error: str | None


class Progress(TypedDict):
    """common.schema.json#/$defs/progress: a released target is also counted under its state."""

    total: int
    dirty: int
    pending: int
    generating: int
    ready: int
    failed: int
    released: int
    released_reasons: dict[str, int]


class CommandStatusRow(TypedDict):
    command_id: str
    stage: str
    status: CommandStatusName
    reason: str | None
    created_at: float
    progress: Progress


class StageState(TypedDict):
    state: AssetStateName
    artifact: str | None
    artifact_uri: str | None  # file:///... or s3://bucket/key; None without an artifact (or one from before 0005)
    error: str | None  # why the pair failed (its job's verdict); None unless it is failed


class SceneStatus(TypedDict):
    chapter_id: str
    scene_id: str
    stages: dict[str, StageState]


class BookStatus(TypedDict):
    """docs/schemas/status.schema.json (`status --json`)"""

    book_id: str
    cancelled: bool
    commands: list[CommandStatusRow]
    scenes: list[SceneStatus]


class CommandListRow(TypedDict):
    """One item of docs/schemas/commands.schema.json (`commands --json`)"""

    command_id: str
    book_id: str
    stage: str
    status: CommandStatusName
    reason: str | None
    progress: Progress
    age_seconds: float


class Consumer(TypedDict):
    hostname: str
    heartbeat_age_seconds: float


class QueueRow(TypedDict):
    """One item of docs/schemas/queues.schema.json (`queues --json`); depth None: the broker could not say."""

    queue: str
    stage: str
    consumers: list[Consumer]
    broker_consumers: int | None
    depth: int | None
    in_flight: int
    lane_limit: int
    books_waiting: int
    breaker: str
    deferred: dict[str, int]
    start_worker: str
    successor_awaited_seconds: NotRequired[float | None]


class Enqueued(TypedDict):
    """What a client call with `wait=False` returns: the Celery task id to poll."""

    task_id: str
