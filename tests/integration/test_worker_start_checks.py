"""`celery -A animastor_tasks worker` without `-Q` consumes every queue it knows (all of `task_queues` but `-X`'s),
so it gets the start checks of a GPU worker for each stage queue among them.

*Why:* the checks looked at `-Q` only. A bare worker with a generator not installed started healthy, advertised
itself on every GPU queue, took the jobs and failed each `misconfigured`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from animastor_tasks.domain.registry import CONTROL_QUEUE
from tests.unit.test_stage_endpoints import start_with_a_generator_not_installed


@pytest.mark.parametrize(
    ("options", "excluded"),
    [({}, set()), ({"queues": None, "exclude_queues": ["gpu.audio"]}, {"gpu.audio"}), ({"exclude_queues": []}, set())],
)
def test_a_worker_without_q_checks_every_queue_it_will_consume(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], excluded: set[str]
) -> None:
    from animastor_tasks.worker import app as app_module

    checked: list[set[str]] = []
    probed: list[bool] = []
    monkeypatch.setattr(app_module, "refuse_generators_not_built", lambda queues: checked.append(set(queues)))
    monkeypatch.setattr(app_module, "refuse_an_artifact_store_that_refuses", lambda: probed.append(True))
    app_module.refuse_unknown_queues(sender="bare@host", instance=None, conf=None, options=options)
    consumed = {CONTROL_QUEUE, *app_module.settings.registry.queues()} - excluded
    assert checked == [consumed] and probed == [True]


def test_a_control_worker_named_by_q_probes_no_artifact_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from animastor_tasks.worker import app as app_module

    checked: list[set[str]] = []
    probed: list[bool] = []
    monkeypatch.setattr(app_module, "refuse_generators_not_built", lambda queues: checked.append(set(queues)))
    monkeypatch.setattr(app_module, "refuse_an_artifact_store_that_refuses", lambda: probed.append(True))
    app_module.refuse_unknown_queues(sender="c@host", instance=None, conf=None, options={"queues": [CONTROL_QUEUE]})
    assert checked == [{CONTROL_QUEUE}] and probed == []


def test_a_bare_celery_worker_whose_generator_is_not_installed_refuses_to_start(tmp_path: Path) -> None:
    done = start_with_a_generator_not_installed(
        ["-m", "celery", "-A", "animastor_tasks", "worker", "-P", "solo"], tmp_path
    )
    assert done.returncode == 2, done.stderr
    assert "generator 'htp' is not installed" in done.stderr and "Traceback" not in done.stderr
