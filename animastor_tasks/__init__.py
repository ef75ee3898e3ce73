"""animastor-tasks: command-only GPU job orchestration on Celery.

`celery -A animastor_tasks ...` finds the Celery app through `app` below; it is
imported lazily so that pure modules (`animastor_tasks.domain`) never pull Celery in.
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        from animastor_tasks.worker.app import app

        return app
    raise AttributeError(name)
