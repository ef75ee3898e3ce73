"""A worker whose stage table's limits differ from the control worker's says so (`worker/presence.py`).

Each process claims against its own table: a GPU worker left at the old `lane_limit` after GPUs were added refilled
its freed slot only below it, and the new slots idled until the tick (a restart hunt: the lane 71% busy with 100
pairs waiting), with no word of it anywhere.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from .harness import audio_stage, image_stage, stage_table

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SAID = "its ANIMASTOR_STAGES disagrees with the control worker's (here/there: audio lane_limit: 2/3)"


def test_a_gpu_worker_left_at_the_old_lane_limit_says_so_and_one_at_the_new_does_not(make_stack: Any) -> None:
    stack = make_stack(stages=stage_table(audio=audio_stage(lane_limit=3), image=image_stage()))
    cluster = stack.cluster
    old_table = stage_table(audio=audio_stage(lane_limit=2), image=image_stage())
    control = cluster.control(wait=False)
    old = cluster.gpu("audio", env={"ANIMASTOR_STAGES": old_table}, wait=False)
    new = cluster.gpu("audio", wait=False)
    cluster.wait_ready(control, old, new, timeout=60)
    old.wait_log(SAID, timeout=20)
    time.sleep(stack.settings.presence_ttl_seconds)  # a few more beats: said once, not at each
    assert old.log().count("disagrees with the control worker's") == 1
    assert "disagrees" not in new.log() and "disagrees" not in control.log()
