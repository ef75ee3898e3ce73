"""Random sequences of intents never authorize or queue a pair without its three conditions.

Runs against real Redis and Postgres; the checks read the stores with their own SQL,
independent of the gate module they verify.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from animastor_tasks.domain.gate import layer_enabled, parse_layers
from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import gate
from animastor_tasks.flow import layers as layers_flow
from animastor_tasks.flow import reconcile as reconcile_flow
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import advertise, fake_artifact, make_book

BOOK = "inv:book*"  # hostile on purpose
SCENES = [("ch1", "s1"), ("ch1", "s2"), ("ch2", "s1"), ("ch2", "s2")]
STAGES = ["audio", "image"]


def authority(rt) -> set[tuple[str, str, str]]:  # type: ignore[no-untyped-def]
    """Pairs that may have work, computed straight from the stores."""
    with rt.db.transaction() as conn:
        tomb = conn.execute("SELECT 1 FROM cancel_tombstones WHERE book_id = %s", (BOOK,)).fetchone()
        raw = conn.execute("SELECT layer_config FROM books WHERE book_id = %s", (BOOK,)).fetchone()[0]
        commanded = {
            tuple(r)
            for r in conn.execute(
                "SELECT t.chapter_id, t.scene_id, c.stage FROM commands c JOIN command_targets t USING (command_id)"
                " WHERE c.book_id = %s AND c.status = 'active'",
                (BOOK,),
            )
        }
    if tomb or rt.redis.client.exists(rt.redis.keys.cancel_flag(BOOK)):
        return set()
    layers = parse_layers(raw)
    return {p for p in commanded if layer_enabled(layers, p[2])}


class CommandOnly(RuleBasedStateMachine):
    rt = None  # set by the test

    @initialize()
    def fresh(self) -> None:
        rt = self.rt
        with rt.db.transaction() as conn:
            conn.execute("DELETE FROM books WHERE book_id = %s", (BOOK,))
            conn.execute("DELETE FROM artifacts WHERE book_id = %s", (BOOK,))
        rt.redis.client.flushdb()
        rt.catalog.import_book(make_book(BOOK, chapters=2, scenes=2))
        advertise(rt, "gpu.audio", "gpu.image")
        self.dispatch_seen = self._dispatch_events()

    def _dispatch_events(self) -> int:
        with self.rt.db.transaction() as conn:
            return conn.execute("SELECT count(*) FROM events WHERE kind = 'dispatch'").fetchone()[0]

    @rule(
        stages=st.lists(st.sampled_from([*STAGES, "all"]), min_size=1, max_size=2),
        scenes=st.none() | st.lists(st.sampled_from(SCENES), min_size=1, max_size=3),
    )
    def regenerate(self, stages, scenes) -> None:  # type: ignore[no-untyped-def]
        before = self._dispatch_events()
        regenerate_flow.regenerate(self.rt.ports, BOOK, stages, [list(s) for s in scenes] if scenes else None)
        self._check_new_dispatches(before)

    @rule(reason=st.none() | st.just("stop"))
    def cancel(self, reason) -> None:  # type: ignore[no-untyped-def]
        cancel_flow.cancel(self.rt.ports, BOOK, reason)

    @rule()
    def cancel_flag_only(self) -> None:
        """A Stop All whose Postgres half failed: the Redis flag alone must stop everything."""
        self.rt.ports.book_state.stop_book(BOOK)

    @rule(stage=st.sampled_from(STAGES), on=st.booleans())
    def toggle_layer(self, stage: str, on: bool) -> None:
        layers_flow.set_layers(self.rt.ports, BOOK, [stage] if on else [], [] if on else [stage])

    @rule()
    def gate_pass(self) -> None:
        before = self._dispatch_events()
        report = gate.gate_pass(self.rt.ports, BOOK)
        allowed = authority(self.rt)
        assert set(report.authorized) <= allowed, (report.authorized, allowed)
        self._check_new_dispatches(before)

    @rule(data=st.data())
    def complete_one(self, data) -> None:  # type: ignore[no-untyped-def]
        with self.rt.db.transaction() as conn:
            rows = conn.execute(
                "SELECT chapter_id, scene_id, stage, fencing_token, dispatch_id FROM asset_states"
                " WHERE book_id = %s AND state = 'generating' ORDER BY 1, 2, 3",
                (BOOK,),
            ).fetchall()
        if not rows:
            return
        c, s, stage, token, dispatch_id = data.draw(st.sampled_from(rows))
        artifact = fake_artifact(dispatch_id)
        self.rt.ports.jobs.commit_job(BOOK, (c, s, stage), token, dispatch_id, artifact, f"gpu.{stage}")

    @rule()
    def lose_every_lease(self) -> None:
        for key in self.rt.redis.client.scan_iter(match=f"{self.rt.redis.keys.prefix}:lease:*"):
            self.rt.redis.client.delete(key)
        reconcile_flow.reconcile(self.rt.ports, force=True)

    def _check_new_dispatches(self, before: int) -> None:
        allowed = authority(self.rt)
        with self.rt.db.transaction() as conn:
            new = conn.execute(
                "SELECT chapter_id, scene_id, stage FROM events WHERE kind = 'dispatch' AND id > ("
                " SELECT coalesce(max(id), 0) FROM (SELECT id FROM events WHERE kind = 'dispatch'"
                " ORDER BY id LIMIT %s) x)",
                (before,),
            ).fetchall()
        assert {tuple(r) for r in new} <= allowed, (new, allowed)

    @invariant()
    def never_pending_without_authority_after_a_pass(self) -> None:
        gate.gate_pass(self.rt.ports, BOOK, dispatch_work=False)
        allowed = authority(self.rt)
        with self.rt.db.transaction() as conn:
            pending = {
                tuple(r)
                for r in conn.execute(
                    "SELECT chapter_id, scene_id, stage FROM asset_states WHERE book_id = %s AND state = 'pending'",
                    (BOOK,),
                )
            }
        assert pending <= allowed, (pending, allowed)


def test_command_only_invariant(rt) -> None:
    CommandOnly.rt = rt
    machine = CommandOnly.TestCase
    machine.settings = settings(
        max_examples=25, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)
    )
    machine().runTest()
