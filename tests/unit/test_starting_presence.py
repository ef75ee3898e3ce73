"""A starting worker's heartbeat (`StartingPresenceStep`): it holds its queues until the consumer's heartbeat takes
over, then never beats again, and what it advertised becomes the consumer heartbeat's to keep or withdraw."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from animastor_tasks.worker import wiring
from animastor_tasks.worker.presence import PresenceStep, StartingPresenceStep

TTL = 0.15  # beats every 50 ms


class Presence:
    def __init__(self) -> None:
        self.beats: list[tuple[str, set[str], float, set[str], bool]] = []
        self.beaten = threading.Event()

    def heartbeat(self, hostname: str, queues: Any, ttl: float, gone: Any = (), *, holding: bool = False) -> set[str]:
        self.beats.append((hostname, set(queues), ttl, set(gone), holding))
        self.beaten.set()
        return set()


@pytest.fixture
def presence(monkeypatch: pytest.MonkeyPatch) -> Presence:
    fake = Presence()
    settings = SimpleNamespace(presence_ttl_seconds=TTL, silent_worker_seconds=60.0)
    current = SimpleNamespace(settings=settings, presence=fake)
    monkeypatch.setattr(wiring, "current", lambda: current)
    return fake


def _worker(*queues: str) -> Any:
    consume_from = {q: object() for q in queues}
    return SimpleNamespace(
        hostname="audio@gpu-1", app=SimpleNamespace(amqp=SimpleNamespace(queues=_Queues(consume_from)))
    )


class _Queues(dict[str, object]):
    def __init__(self, consume_from: dict[str, object]) -> None:
        super().__init__(consume_from)
        self.consume_from = consume_from


def test_a_starting_worker_holds_its_queues_until_its_consumer_beats(presence: Presence) -> None:
    worker = _worker("gpu.audio")
    step = StartingPresenceStep(worker)
    assert worker.starting_presence is step
    step.start(worker)
    assert presence.beaten.wait(2)
    time.sleep(TTL)  # a beat or two more
    assert presence.beats[0] == ("audio@gpu-1", {"gpu.audio"}, TTL, set(), True)
    assert all(beat[4] for beat in presence.beats), "a beat said it consumed: on AMQP the broker's zero would win"

    assert step.hand_over() == {"gpu.audio"}
    beaten = len(presence.beats)
    time.sleep(TTL)
    assert len(presence.beats) == beaten, "it beat after the consumer's heartbeat took over"
    assert step.hand_over() == set(), "handed over once: a queue cancelled since must not come back"


def test_a_worker_stopping_before_its_consumer_beats_withdraws_nothing(presence: Presence) -> None:
    """Its entries expire within a TTL, as a killed worker's: a withdrawal would note a clean departure, and the
    stage would wait `silent_worker_seconds` for a successor of a worker that failed to start."""
    worker = _worker("gpu.audio")
    step = StartingPresenceStep(worker)
    step.start(worker)
    assert presence.beaten.wait(2)
    step.stop(worker)
    beaten = len(presence.beats)
    time.sleep(TTL)
    assert len(presence.beats) == beaten
    assert all(ttl > 0 and not gone for _, _, ttl, gone, _ in presence.beats)


def test_the_consumers_heartbeat_withdraws_what_the_start_held_and_it_does_not_consume(presence: Presence) -> None:
    worker = _worker("gpu.audio", "gpu.image")
    starting = StartingPresenceStep(worker)
    starting.start(worker)
    assert presence.beaten.wait(2)

    consumer = SimpleNamespace(
        controller=worker,
        hostname=worker.hostname,
        blueprint=SimpleNamespace(state=None),
        task_consumer=SimpleNamespace(queues=[SimpleNamespace(name="gpu.audio")]),  # gpu.image cancelled meanwhile
    )
    step = PresenceStep(consumer)
    presence.beats.clear()
    step.start(consumer)
    try:
        deadline = time.monotonic() + 2
        while not presence.beats and time.monotonic() < deadline:
            time.sleep(0.01)
        assert presence.beats[0] == ("audio@gpu-1", {"gpu.audio"}, TTL, {"gpu.image"}, False)
    finally:
        step._stop.set()
        step._wake.set()


def test_a_worker_whose_consumer_never_starts_holds_its_queues_no_longer_than_a_silent_worker_is_waited_for(
    presence: Presence,
) -> None:
    """A worker that cannot reach its broker (a wrong host or password: Celery retries for ever) held its queues for
    ever: its stage was never BLOCKED, its jobs waited in a queue nobody consumed, and no alert fired."""
    wiring.current().settings.silent_worker_seconds = 4 * TTL
    worker = _worker("gpu.audio")
    step = StartingPresenceStep(worker)
    step.start(worker)
    assert presence.beaten.wait(2)
    time.sleep(8 * TTL)
    beaten = len(presence.beats)
    assert 0 < beaten <= 13, presence.beats  # every TTL/3 for 4 TTLs at most
    time.sleep(2 * TTL)
    assert len(presence.beats) == beaten, "it beat on past the silent-worker wait"
    step.stop(worker)
