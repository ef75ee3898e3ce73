"""Issue 7, item 1, beyond tests/e2e (5 kills over 10 jobs): at least 10 SIGKILLs of GPU workers in the middle of
a job over at least 50 jobs. The scenario is the e2e one (`sigkill_trials` in the harness), run bigger: two image
workers (one down at a time, the other keeps working), every killed pair released within lease TTL + one
reconcile, every pair ready with exactly one artifact, no killed dispatch committed.
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import sigkill_trials

from .scale import current as current_scale

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.timeout(current_scale().pick(300, 900))]


def test_sigkill_gpu_workers_mid_job_at_least_ten_times_over_fifty_jobs(make_stack, figure, scale) -> None:
    kills = scale.pick(10, 30)
    chapters = scale.pick(5, 15)  # x 10 scenes: 50 (ci) or 150 (long) image jobs
    result = sigkill_trials(
        make_stack,
        figure,
        kills=kills,
        chapters=chapters,
        scenes=10,
        workers=2,
        job={"steps": 4, "step_seconds": 0.15},  # 0.6 s per image
        timeout=120 if scale.long else 90,
    )
    assert result["kills"] >= 10 and result["pairs"] >= 50
