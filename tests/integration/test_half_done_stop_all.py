"""A Stop All whose Postgres half failed (its flag set, no tombstone): the flag alone stops the book, and a
pass releases the pairs it left `pending` (the command-only invariant: never pending without authority);
a flag a regenerate is lifting, or one that only mirrored a tombstone since deleted, releases nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import advertise, make_book, states, use_settings


@pytest.fixture
def book(rt):  # type: ignore[no-untyped-def]
    """A book whose regenerate leaves pairs pending: one slot per book and stage."""
    rt.catalog.import_book(make_book("b1", chapters=2, scenes=3))
    advertise(rt, "gpu.audio", "gpu.image")
    stages = tuple(replace(s, book_cap=1) for s in rt.settings.registry.stages)
    use_settings(rt, replace(rt.settings, registry=replace(rt.settings.registry, stages=stages)))
    regenerate_flow.regenerate(rt.ports, "b1", ["audio"])
    assert list(states(rt, "b1").values()).count("pending") == 5
    return "b1"


def _stop_all_without_postgres(rt, book: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def down(*args: object) -> None:
        raise StoreUnavailable("postgres", rt.settings.database_url, "connection refused")

    monkeypatch.setattr(rt.ports.commands, "cancel_book", down)
    with pytest.raises(StoreUnavailable):
        cancel_flow.cancel(rt.ports, book, "reader pressed stop")
    monkeypatch.undo()
    assert rt.ports.book_state.cancel_flag_set(book) and not rt.ports.commands.is_tombstoned(book)


def test_a_pass_releases_the_pending_pairs_of_a_stop_all_whose_postgres_half_failed(rt, book, monkeypatch) -> None:
    """Judged under the book's lock on Postgres's facts alone, no tombstone said cancelled: the pairs stayed
    `pending` under the flag for as long as it stood, each pass denying them, their command active."""
    _stop_all_without_postgres(rt, book, monkeypatch)
    report = gate.gate_pass(rt.ports, book, dispatch_work=False)
    assert len(report.released) == 5
    assert "pending" not in states(rt, book).values()


def test_a_flag_set_while_a_regenerate_lifts_it_releases_nothing(rt, book) -> None:
    """A Stop All's flag that came between a regenerate's lift and its commands (its tombstone, if any, deleted
    by them): the regenerate lifts it again once its commands are written, and its work runs. A pass in between
    that released the pairs would have ended the new command with nothing run."""
    lifted = rt.ports.book_state.lift_cancel_flag(book, "request-1", rt.ports.clock())
    assert not lifted
    rt.ports.book_state.stop_book(book)
    gate.gate_pass(rt.ports, book, dispatch_work=False)
    assert list(states(rt, book).values()).count("pending") == 5


def test_a_flag_mirroring_a_tombstone_since_deleted_releases_nothing(rt, book) -> None:
    """Reconcile sets the flags of the tombstoned books it read; a regenerate may delete a tombstone between that
    read and the write. Such a flag stands only on its tombstone (reconcile lifts it again)."""
    rt.ports.book_state.set_cancel_flags([book])
    gate.gate_pass(rt.ports, book, dispatch_work=False)
    assert list(states(rt, book).values()).count("pending") == 5


def test_a_mirrored_flag_does_not_overwrite_a_stop_alls_own(rt, book, monkeypatch) -> None:
    _stop_all_without_postgres(rt, book, monkeypatch)
    rt.ports.book_state.set_cancel_flags([book])
    assert len(gate.gate_pass(rt.ports, book, dispatch_work=False).released) == 5


def test_a_refused_regenerate_puts_back_a_stop_alls_own_flag(rt, book, monkeypatch) -> None:
    """A regenerate lifts the flag first; refused after that (its commands not written), it put the flag back only
    while a tombstone stood: the flag of a Stop All whose Postgres half failed, all that stopped the book, was gone."""
    _stop_all_without_postgres(rt, book, monkeypatch)

    def down(*args: object) -> None:
        raise StoreUnavailable("postgres", rt.settings.database_url, "connection refused")

    monkeypatch.setattr(rt.ports.commands, "create_commands", down)
    with pytest.raises(StoreUnavailable):
        regenerate_flow.regenerate(rt.ports, book, ["audio"])
    monkeypatch.undo()
    assert rt.ports.book_state.cancel_flag_set(book)
    assert not rt.redis.client.exists(rt.redis.keys.lifting(book))  # its lift over: nothing holds the release back
    assert len(gate.gate_pass(rt.ports, book, dispatch_work=False).released) == 5


def test_reconcile_lifts_a_mirrored_flag_but_never_a_stop_alls_own(rt, book, monkeypatch) -> None:
    """Reconcile sets the flags of the tombstones it read, then lifts those whose tombstone is gone since: a Stop All
    whose flag came in between (its Postgres half failed) lost it."""
    rt.ports.book_state.set_cancel_flags([book])
    rt.ports.book_state.clear_mirror_flag(book)
    assert not rt.ports.book_state.cancel_flag_set(book)
    _stop_all_without_postgres(rt, book, monkeypatch)
    rt.ports.book_state.clear_mirror_flag(book)
    assert rt.ports.book_state.cancel_flag_set(book)
