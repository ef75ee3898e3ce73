"""Command lines of the Celery processes started locally (demo, tests, benchmarks).

Why `python -m celery`: the interpreter running us is the one whose environment has animastor_tasks.
"""

from __future__ import annotations

import os
import sys


def log_level() -> str:
    """The level local Celery processes log at: ANIMASTOR_LOG_LEVEL, else INFO (the INFO lines tell the story)."""
    from animastor_tasks.worker.logs import level_from_env

    return level_from_env(os.environ)


def celery_argv(*args: str, app: str = "animastor_tasks") -> list[str]:
    """`celery -A <app> <args>` run by this interpreter."""
    return [sys.executable, "-m", "celery", "-A", app, *args]


def worker_argv(queue: str, hostname: str, concurrency: int = 1) -> list[str]:
    """The same worker `animastor-tasks worker [--stage S]` starts, minus mingle/gossip (faster start)."""
    return celery_argv(
        "worker",
        "-Q",
        queue,
        "-c",
        str(concurrency),
        "--prefetch-multiplier",
        "1",
        "-n",
        hostname,
        "-E",
        "-l",
        log_level(),
        "--without-mingle",
        "--without-gossip",
    )
