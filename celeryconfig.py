"""Celery settings for animastor-tasks, built from the ANIMASTOR_* environment.

The app loads this module (`celery -A animastor_tasks ...`); it is installed as a
top-level module so a deployment can replace it. The rules (queues, routes, beat
schedule, delivery) live in `animastor_tasks/worker/celery_config.py`; the settings
hold broker and backend URLs with their credentials, so never print or log them.
"""

from animastor_tasks.config import Settings
from animastor_tasks.worker.celery_config import build_config

globals().update(build_config(Settings.from_env()))
