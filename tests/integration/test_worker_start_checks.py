"""`celery -A animastor_tasks worker` without `-Q` consumes every queue it knows (all of `task_queues` but `-X`'s),
so it gets the start checks of a GPU worker for each stage queue among them.

*Why:* the checks looked at `-Q` only. A bare worker with a generator not installed started healthy, advertised
itself on every GPU queue, took the jobs and failed each `misconfigured`.

A worker that would consume the control queue and a GPU queue together is refused: a long GPU job held up the
control work queued behind it (gate passes, regenerate, Stop All), and control work took a GPU slot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from animastor_tasks.domain.registry import CONTROL_QUEUE
from tests.unit.test_stage_endpoints import start_with_a_generator_not_installed


@pytest.mark.parametrize(
    ("options", "excluded"),
    [
        ({"exclude_queues": [CONTROL_QUEUE]}, {CONTROL_QUEUE}),
        ({"queues": None, "exclude_queues": [f"{CONTROL_QUEUE},gpu.audio"]}, {CONTROL_QUEUE, "gpu.audio"}),
        ({"exclude_queues": CONTROL_QUEUE}, {CONTROL_QUEUE}),
    ],
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
        ["-m", "celery", "-A", "animastor_tasks", "worker", "-P", "solo", "-X", CONTROL_QUEUE], tmp_path
    )
    assert done.returncode == 2, done.stderr
    assert "generator 'htp' is not installed" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("options", "gpu_queues"),
    [
        ({"queues": [f"{CONTROL_QUEUE},gpu.audio"]}, "gpu.audio"),
        ({"queues": [CONTROL_QUEUE, "gpu.image"]}, "gpu.image"),
        ({}, "gpu.audio, gpu.image"),  # no -Q: every queue
        ({"exclude_queues": ["gpu.audio"]}, "gpu.image"),
    ],
)
def test_a_worker_consuming_the_control_queue_and_a_gpu_queue_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], options: dict[str, Any], gpu_queues: str
) -> None:
    from animastor_tasks.worker import app as app_module

    checked: list[set[str]] = []
    monkeypatch.setattr(app_module, "refuse_generators_not_built", lambda queues: checked.append(set(queues)))
    monkeypatch.setattr(app_module, "refuse_an_artifact_store_that_refuses", lambda: checked.append(set()))
    with pytest.raises(SystemExit) as stopped:
        app_module.refuse_unknown_queues(sender="mixed@host", instance=None, conf=None, options=options)
    said = capsys.readouterr().err
    assert stopped.value.code == 2 and checked == []
    assert f"{CONTROL_QUEUE} and GPU queue(s) {gpu_queues}" in said and "separate workers" in said, said


def test_a_bare_celery_worker_refuses_to_start_naming_the_queues(tmp_path: Path) -> None:
    """Without -Q it would consume the control queue and every GPU queue: refused before any generator is built."""
    done = start_with_a_generator_not_installed(
        ["-m", "celery", "-A", "animastor_tasks", "worker", "-P", "solo"], tmp_path
    )
    assert done.returncode == 2, done.stderr
    assert f"{CONTROL_QUEUE} and GPU queue(s) gpu.audio" in done.stderr and "separate workers" in done.stderr
    assert "htp" not in done.stderr and "Traceback" not in done.stderr
