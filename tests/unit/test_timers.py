"""`worker.timers.drop_cancelled` on kombu's own event-loop timer: the cancelled entries go, the others fire in
their order, and a timer's iterator taken before the drop (the event loop holds one) sees the same list."""

from __future__ import annotations

from kombu.asynchronous.timer import Timer

from animastor_tasks.worker.timers import drop_cancelled


def test_cancelled_entries_go_and_the_rest_fire_in_order() -> None:
    timer = Timer()
    fired: list[int] = []
    entries = [timer.call_after(-10 + n, fired.append, (n,)) for n in range(10)]  # all due already
    schedule = iter(timer)  # as the event loop holds it
    for n in (0, 3, 4, 9):
        entries[n].cancel()

    assert drop_cancelled(timer) == 4
    assert drop_cancelled(timer) == 0
    assert len(timer._queue) == 6
    for _ in range(6):
        _, entry = next(schedule)
        timer.apply_entry(entry)
    assert fired == [1, 2, 5, 6, 7, 8]
    assert timer._queue == []
