"""Flower settings for `celery -A animastor_tasks flower --conf=flowerconfig.py`, kept for that command line.

The settings and their rules (basic auth required: ANIMASTOR_FLOWER_BASIC_AUTH; refusal with exit status 2
otherwise) live in the package, `animastor_tasks/worker/flower_settings.py`, so that an installed
animastor-tasks needs no file from the source tree: `animastor-tasks flower` starts Flower with them.

Flower executes this file and takes every global whose name is a Flower option, hence the underscores.
"""

import os as _os

from animastor_tasks.worker.flower_settings import options_or_exit as _options_or_exit

globals().update(_options_or_exit(_os.environ))
