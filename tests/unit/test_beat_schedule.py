"""Beat's tick and reconcile survive a clock stepped back, within a beat and across its restart."""

from __future__ import annotations

import shelve
from datetime import UTC, datetime, timedelta
from pathlib import Path

from celery import Celery
from celery.utils.imports import symbol_by_name

from animastor_tasks.config import Settings
from animastor_tasks.worker.celery_config import build_config

ENTRIES = ("animastor-tick", "animastor-reconcile")


def _app() -> Celery:
    app = Celery("beat_test")
    app.conf.update(build_config(Settings(tick_seconds=5.0, reconcile_seconds=30.0)))
    return app


def _scheduler(app: Celery, schedule: Path):  # type: ignore[no-untyped-def]
    """The scheduler `celery beat -s <schedule>` makes from the configuration, its sends recorded."""
    scheduler = symbol_by_name(app.conf.beat_scheduler)(app, schedule_filename=str(schedule), lazy=False)
    sent: list[str] = []
    scheduler.apply_entry = lambda entry, producer=None: sent.append(entry.name)
    scheduler.sent = sent
    return scheduler


def test_a_last_run_in_the_future_is_due_within_one_interval(tmp_path: Path) -> None:
    """Old code (PersistentScheduler): a last run 10 min ahead was next due in ~605 s, tick and reconcile alike."""
    app = _app()
    scheduler = _scheduler(app, tmp_path / "celerybeat-schedule")
    ahead = datetime.now(UTC) + timedelta(minutes=10)
    for name in ENTRIES:
        entry = scheduler.schedule[name]
        entry.last_run_at = ahead
        _due, next_in = entry.is_due()
        assert next_in <= entry.schedule.run_every.total_seconds() + 0.1, (name, next_in)


def test_a_schedule_file_written_by_a_clock_ahead_does_not_hold_back_a_restarted_beat(tmp_path: Path) -> None:
    """Old code: the last runs stored in `-s` by a clock an hour ahead held the next beat's tick back an hour."""
    app = _app()
    path = tmp_path / "celerybeat-schedule"
    first = symbol_by_name("celery.beat:PersistentScheduler")(app, schedule_filename=str(path), lazy=False)
    ahead = datetime.now(UTC) + timedelta(hours=1)
    for name in ENTRIES:
        first.schedule[name].last_run_at = ahead
    first.close()
    with shelve.open(str(path)) as stored:  # the file as an old beat left it
        assert stored["entries"]["animastor-tick"].last_run_at == ahead
    scheduler = _scheduler(app, path)
    waits = [scheduler.tick() for _ in range(3)]
    assert sorted(scheduler.sent) == sorted(ENTRIES), waits  # each due once at start, no backlog


def test_a_clock_stepped_back_while_beat_runs_keeps_the_tick_going(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Old code: after a step back of an hour the last runs, and beat's heap, were an hour ahead: no tick."""
    app = _app()
    clock = [datetime.now(UTC)]
    monkeypatch.setattr(app, "now", lambda: clock[0])
    scheduler = _scheduler(app, tmp_path / "celerybeat-schedule")

    def run_due() -> None:
        while scheduler.tick() == 0:
            pass

    run_due()
    scheduler.sent.clear()
    clock[0] -= timedelta(hours=1)
    for _ in range(4):
        clock[0] += timedelta(seconds=3)
        run_due()
    assert "animastor-tick" in scheduler.sent
