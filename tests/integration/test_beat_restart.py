"""A beat restarted on a schedule file written by a clock an hour ahead sends its tick at once, writing nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from celery import Celery
from celery.beat import PersistentScheduler

from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.worker.celery_config import build_config
from tests.integration.helpers import queued_messages


def test_beat_on_a_schedule_file_from_a_clock_ahead_ticks_at_once_and_writes_nothing(rt, settings, tmp_path) -> None:
    """Old code: beat read the last runs an hour ahead from `-s` and sent no tick for an hour; it also needed a
    writable schedule path (the image's default, /app/celerybeat-schedule, is not the animastor user's)."""
    app = Celery("old_beat")
    app.conf.update(build_config(settings))
    schedule = tmp_path / "celerybeat-schedule"
    old = PersistentScheduler(app, schedule_filename=str(schedule), lazy=False)
    for entry in old.schedule.values():
        entry.last_run_at = datetime.now(UTC) + timedelta(hours=1)
    old.close()
    written = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = tmp_path / "beat.log"
    with log.open("wb") as out:
        beat = subprocess.Popen(
            [sys.executable, "-m", "animastor_tasks.operator.cli", "beat", "-s", str(schedule), "-l", "INFO"],
            cwd=run_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
    try:
        deadline = time.monotonic() + 20
        # Beat logs "Sending due task" before it publishes: stopped at once on a slow machine, it had sent nothing yet.
        while time.monotonic() < deadline and not (
            "Sending due task animastor-tick" in log.read_text() and queued_messages(rt, CONTROL_QUEUE) >= 1
        ):
            assert beat.poll() is None, log.read_text()
            time.sleep(0.2)
    finally:
        beat.terminate()
        beat.wait(10)
    assert "Sending due task animastor-tick" in log.read_text(), log.read_text()
    assert queued_messages(rt, CONTROL_QUEUE) >= 1
    assert list(run_dir.iterdir()) == []
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name not in ("run", "beat.log")} == written
