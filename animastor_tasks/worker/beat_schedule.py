"""Beat's scheduler: tick and reconcile keep their rhythm whatever beat's wall clock does.

Celery's default (`PersistentScheduler`) keeps each entry's last run, by beat's wall clock, in the `-s` file, and
its heap of next runs by the same clock: a clock stepped back (NTP, a VM restored) put both in the future, and
beat sent neither task for as long as the step, even after a restart, which read the file again. Tick and
reconcile are idempotent and owe nothing to a missed run, so this scheduler keeps nothing on disk (`-s` is
accepted and unused: no writable path needed), makes each entry due once at start, and takes a last run in the
future for one just now.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from celery import beat
from celery.schedules import schedule as interval_schedule
from celery.utils.time import maybe_make_aware

#: A wall clock read earlier than the last reading by more than this has been stepped back.
STEP_BACK_SECONDS = 1.0


class ClockSafeEntry(beat.ScheduleEntry):
    """An entry whose last run, if the clock now says it is still to come, counts as now."""

    def is_due(self) -> Any:
        now = maybe_make_aware(self.default_now())
        last: datetime = vars(self)["last_run_at"]  # set by __init__ (mypy cannot type celery's class attribute)
        if maybe_make_aware(last) > now:
            self.last_run_at = now
        return super().is_due()


class Scheduler(beat.Scheduler):
    """Not persisted; entries due at start; a clock stepped back rebuilds the heap of next runs."""

    Entry = ClockSafeEntry

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._last_now: datetime | None = None
        super().__init__(*args, **kwargs)

    def setup_schedule(self) -> None:
        super().setup_schedule()
        for entry in self.schedule.values():  # due at once: a restart is the moment a missed run is wanted
            if isinstance(entry.schedule, interval_schedule):
                entry.last_run_at = entry.default_now() - entry.schedule.run_every

    def tick(self, *args: Any, **kwargs: Any) -> float:
        now = maybe_make_aware(self.app.now())
        if self._last_now is not None and now < self._last_now - timedelta(seconds=STEP_BACK_SECONDS):
            self._heap = None  # its times are by the old clock: rebuilt from the entries, which clamp
        self._last_now = now
        return float(super().tick(*args, **kwargs))
