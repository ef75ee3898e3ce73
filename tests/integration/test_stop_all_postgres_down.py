"""Stop All while Postgres cannot be reached: the book's existence could not be read, and the Stop All wrote nothing,
the cancel flag included; the running jobs, which only that flag stops, ran on to their end and committed once
Postgres was back. The flag goes first whatever Postgres says (the caller is told to send the Stop All again)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from animastor_tasks.adapters.postgres.catalog import Catalog
from animastor_tasks.adapters.postgres.commands import CommandStore
from animastor_tasks.adapters.postgres.pool import Database
from animastor_tasks.errors import InvalidCommand, StoreUnavailable
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.worker.wiring import Wiring

from .helpers import advertise, make_book, states


def cancel_flag(rt: Wiring, book: str) -> bool:
    return bool(rt.redis.client.exists(rt.redis.keys.cancel_flag(book)))


def test_a_stop_all_that_cannot_reach_postgres_still_stops_the_running_jobs(rt: Wiring) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    assert "generating" in states(rt, "b").values() and not cancel_flag(rt, "b")
    unreachable = Database("postgresql://postgres@127.0.0.1:1/none", timeout=1)
    try:
        down = replace(rt.ports, catalog=Catalog(unreachable, rt.settings.registry), commands=CommandStore(unreachable))
        with pytest.raises(StoreUnavailable):
            cancel_flow.cancel(down, "b")
    finally:
        unreachable.close()
    assert cancel_flag(rt, "b")  # running jobs stop on it now
    cancel_flow.cancel(rt.ports, "b")  # sent again once Postgres answers: the rest of the Stop All
    assert set(states(rt, "b").values()) == {"dirty"}


def test_a_stop_all_of_a_malformed_book_id_sets_nothing(rt: Wiring) -> None:
    with pytest.raises(InvalidCommand):
        cancel_flow.cancel(rt.ports, "no such:book")
    assert not cancel_flag(rt, "no such:book")
