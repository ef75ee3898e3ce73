"""Celery settings for animastor-tasks, built from the ANIMASTOR_* environment.

The app loads these itself (`celery -A animastor_tasks ...`); this module exists so
operators can read the effective configuration: `python -c "import celeryconfig, pprint;
pprint.pprint(celeryconfig.CONFIG)"`. The rules live in `animastor_tasks/celery_config.py`.
"""

from animastor_tasks.config import Settings
from animastor_tasks.worker.celery_config import build_config

CONFIG = build_config(Settings.from_env())
globals().update(CONFIG)
