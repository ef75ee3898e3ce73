"""The live views against the real stores and broker: queue depths read (or `?`), and the
`status` screen of a real book."""

from __future__ import annotations

from typing import Any

import pytest
from kombu.transport import redis as kombu_redis

from animastor_tasks.adapters.broker_probe import passive_depths
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import advertise, make_book, queued_messages
from .test_cli_reads import cli


def test_queue_depths_from_the_real_broker(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    advertise(rt, "gpu.audio", host="audio@box")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert queued_messages(rt, "gpu.audio") == 3
    depths = passive_depths(rt.settings.broker_url, ["gpu.audio", "gpu.never-declared"])
    assert depths == {"gpu.audio": 3, "gpu.never-declared": 0}  # no queue yet: nothing waits in it


def test_a_depth_the_broker_cannot_give_is_unknown(rt, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Any, queue: str, passive: bool = False, **kwargs: Any) -> Any:
        raise ConnectionError("connection reset while asking for the depth")

    monkeypatch.setattr(kombu_redis.Channel, "queue_declare", broken)
    depths = passive_depths(rt.settings.broker_url, ["gpu.audio"])
    assert depths == {"gpu.audio": None}


def test_cli_status_and_queues_screens(rt, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # not a terminal: rich would assume 80
    rt.catalog.import_book(make_book("b", chapters=2, scenes=3))
    advertise(rt, "gpu.audio", host="audio@box")
    regenerate_flow.regenerate(rt.ports, "b", ["all"])
    done = cli("status", "b")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.split()[:1] == ["ch1"] for line in lines) and "scenes (6)" in done.stdout
    assert "no_worker:image" in done.stdout and "image: · dirty 6" in done.stdout
    done = cli("queues")
    assert done.returncode == 0 and "gpu.audio" in done.stdout and "audio@box" in done.stdout
