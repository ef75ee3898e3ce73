"""What Postgres lost, or what was lost of its answers, is asked for again at once, not at reconcile's round: a
batch pass that met it, a job whose claim a crash lost, a regenerate whose commands it lost, a server timeout
(real Postgres and Redis; the failures are injected at the store's edge, as in test_job_troubles.py)."""

from __future__ import annotations

import psycopg
import pytest

from animastor_tasks.adapters.postgres.pool import _is_store_error
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import gate
from animastor_tasks.flow import regenerate as regenerate_flow
from animastor_tasks.flow.generate import run_job
from animastor_tasks.worker.wiring import Wiring

from .helpers import make_book
from .test_generate import dispatched_jobs
from .test_job_troubles import _one_scene


def _due(rt: Wiring, book: str) -> bool:
    return rt.redis.client.zscore(rt.redis.keys.due(), book) is not None


def test_a_batch_pass_that_meets_postgres_leaves_its_book_due(rt, tmp_path, monkeypatch) -> None:
    """The tick took the book off the due index and its pass met Postgres still flapping (a dead pooled
    connection, a statement timeout): nothing wrote it back, and its pending pairs waited for reconcile's round."""
    _one_scene(rt, tmp_path, scenes=2)
    rt.redis.client.delete(rt.redis.keys.due())  # as the tick's take of the due books

    def flapping(*_a: object, **_k: object) -> None:
        raise StoreUnavailable("postgres", rt.settings.database_url, "terminating connection")

    monkeypatch.setattr(rt.ports.assets, "gate_rows_many", flapping)
    gate.gate_batch(rt.ports, ["b"])
    assert _due(rt, "b")


def test_a_job_whose_claim_a_crash_lost_makes_its_book_due(rt, tmp_path) -> None:
    """The claim commits without waiting for its WAL flush: a crash right after loses it, the pair `pending` again
    with its old token. The delivered job was refused as stale and only let go of its lease; the claim's pass had
    taken the book off the due index and the waiting list, and the pair waited for reconcile's round."""
    _one_scene(rt, tmp_path)
    [job] = dispatched_jobs(rt, "b")
    with rt.db.transaction() as conn:  # what the crash left: the claim undone
        conn.execute(
            "UPDATE asset_states SET state = 'pending', fencing_token = fencing_token - 1, dispatch_id = NULL"
            " WHERE book_id = 'b'"
        )
    rt.redis.client.delete(rt.redis.keys.due())
    assert run_job(rt.ports, job, worker="test@local:1")["outcome"] == "fence_rejected"
    assert _due(rt, "b")
    gate.gate_pass(rt.ports, "b")  # the pass the due index asks for dispatches the pair again
    assert [again.scene_id for again in dispatched_jobs(rt, "b")] == ["s1"]


def test_a_regenerate_whose_commands_postgres_lost_says_send_again(rt, monkeypatch) -> None:
    """A crash lost the commands' unflushed commit: their statuses came back empty and the regenerate raised a bare
    KeyError, a bug to the caller, where a store error tells it to send the same request again."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    monkeypatch.setattr(rt.ports.commands, "command_statuses", lambda ids: {})
    with pytest.raises(StoreUnavailable, match="send the request again"):
        regenerate_flow.regenerate(rt.ports, "b", ["audio"])


@pytest.mark.parametrize("error", [psycopg.errors.IdleInTransactionSessionTimeout, psycopg.errors.TransactionTimeout])
def test_the_servers_own_timeouts_are_store_errors(error: type[Exception]) -> None:
    """They end the session as a restart does, but are InternalErrors: a GPU start check meeting one was a bug."""
    assert _is_store_error(error())
