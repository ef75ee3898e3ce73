"""Logs of real workers: INFO by default (the `[GENERATE]` and `[WORKER]` lines the docs promise), one JSON
object per line with ANIMASTOR_LOG_FORMAT=json, and every line of a GPU job carrying its command_id.

Also the pieces in-process: how the level is chosen, the JSON fields, and Flower's packaged settings read
the way Flower (Tornado) reads a `--conf` file.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from animastor_tasks.dev.celery_commands import celery_argv
from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.errors import ConfigError
from animastor_tasks.worker import flower_settings, logs
from tests.support.stack import Stack

from . import make_book, operator_env

CLI = [sys.executable, "-m", "animastor_tasks.operator.cli"]


def run_book(stack: Stack, book_id: str, scenes: int = 2) -> tuple[str, dict[tuple[str, str, str], dict[str, Any]]]:
    """Import a book, regenerate its audio, wait until it completed; (command_id, asset rows)."""
    stack.rt.catalog.import_book(make_book(book_id, scenes=scenes))
    result = stack.client.regenerate(book_id, ["audio"])
    command_id = str(result["commands"][0]["command_id"])
    stack.wait_commands(book_id, ["audio"], "completed", timeout=60)
    return command_id, stack.asset_rows(book_id)


def json_lines(text: str, name: str) -> list[dict[str, Any]]:
    """Every line of a log as a JSON object; fails naming the first line that is not one."""
    parsed = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"{name} line {number} is not JSON: {line!r}\n{text[-3000:]}") from None
        assert isinstance(obj, dict), f"{name} line {number}: {line!r}"
        parsed.append(obj)
    return parsed


def test_json_log_lines_carry_the_job_and_its_command(tmp_path: Path) -> None:
    with operator_env(tmp_path, ANIMASTOR_LOG_FORMAT="json") as env:
        env.pop("ANIMASTOR_LOG_LEVEL", None)
        stack = Stack(env, tmp_path)
        try:
            stack.start_control()
            # The GPU worker as operators start it: `animastor-tasks worker --stage audio`, no level given.
            stack.supervisor.start("audio", [*CLI, "worker", "--stage", "audio", "--without-mingle"])
            stack.wait_consumers(CONTROL_QUEUE, "gpu.audio")
            command_id, assets = run_book(stack, "jsonbook")
        finally:
            stack.close()
        texts = {p.stem: p.read_text() for p in stack.supervisor.log_dir.glob("*.log")}

    records = {name: json_lines(text, name) for name, text in texts.items()}
    for name, lines in records.items():
        assert lines, f"{name} logged nothing"
        for obj in lines:
            assert {"time", "level", "component", "message", "logger"} <= obj.keys(), obj
    gpu = records["audio"]
    assert any(o["component"] == "WORKER" and "consuming gpu.audio" in o["message"] for o in gpu), gpu[:5]
    job_lines = [o for o in gpu if o.get("command_id") == command_id]
    print(f"{len(gpu)} JSON lines from the GPU worker, {len(job_lines)} carry command_id {command_id}; e.g.")
    for obj in job_lines[:3]:
        print(json.dumps(obj, sort_keys=True))
    jobs = {pair: row for pair, row in assets.items() if pair[2] == "audio"}
    assert len(jobs) == 2 and all(row["state"] == "ready" for row in jobs.values()), assets
    for (chapter, scene, stage), row in jobs.items():
        mine = [o for o in job_lines if o.get("dispatch_id") == row["dispatch_id"]]
        messages = " | ".join(o["message"] for o in mine)
        assert "started on" in messages and "ready sha256=" in messages, (scene, messages, job_lines)
        for obj in mine:
            assert (obj["book"], obj["chapter"], obj["scene"], obj["stage"]) == ("jsonbook", chapter, scene, stage)
    # Every line the job itself logs has the command: none of its [GENERATE] lines goes without.
    generate = [o for o in gpu if o["component"] == "GENERATE"]
    assert generate and all(o.get("command_id") == command_id for o in generate), generate
    control = records["control"]
    assert any(o["component"] == "COMMAND" and o.get("book") == "jsonbook" for o in control), control[-10:]


def test_default_level_is_info_for_every_way_of_starting_a_worker(tmp_path: Path) -> None:
    """No `-l` anywhere: plain `celery worker` (the control worker here) and `animastor-tasks worker` log INFO."""
    with operator_env(tmp_path) as env:
        for key in ("ANIMASTOR_LOG_LEVEL", "ANIMASTOR_LOG_FORMAT"):
            env.pop(key, None)
        stack = Stack(env, tmp_path)
        try:
            plain = celery_argv("worker", "-Q", CONTROL_QUEUE, "-c", "1", "-n", "control@%h", "--without-gossip")
            stack.supervisor.start("control", plain)
            stack.supervisor.start("audio", [*CLI, "worker", "--stage", "audio", "--without-mingle"])
            stack.wait_consumers(CONTROL_QUEUE, "gpu.audio")
            command_id, _ = run_book(stack, "textbook", scenes=1)
        finally:
            stack.close()
        audio = (stack.supervisor.log_dir / "audio.log").read_text()
        control = (stack.supervisor.log_dir / "control.log").read_text()
    generate = [line for line in audio.splitlines() if "[GENERATE]" in line]
    print("\n".join(generate))
    assert any("started on" in line for line in generate), audio[-3000:]
    assert all(f"command_id={command_id}" in line for line in generate), generate  # text lines carry it too
    assert "[WORKER]" in audio and "[WORKER]" in control, (audio[-2000:], control[-2000:])
    assert "[COMMAND]" in control, control[-3000:]


def test_a_level_given_wins_over_the_environment(tmp_path: Path) -> None:
    """`-l WARNING` on the command line beats ANIMASTOR_LOG_LEVEL=DEBUG; the variable beats the INFO default."""
    argv = ["celery", "-A", "animastor_tasks", "worker", "-l", "WARNING"]
    assert logs.effective_level(logging.WARNING, argv, {"ANIMASTOR_LOG_LEVEL": "DEBUG"}) == logging.WARNING
    assert logs.effective_level(logging.WARNING, ["celery", "worker"], {"ANIMASTOR_LOG_LEVEL": "debug"}) == 10
    assert logs.effective_level(logging.WARNING, ["celery", "beat"], {}) == logging.INFO
    assert logs.effective_level(logging.ERROR, ["celery", "beat", "--loglevel=ERROR"], {}) == logging.ERROR
    assert logs.effective_level(logging.ERROR, ["celery", "beat"], {"CELERY_BEAT_LOGLEVEL": "ERROR"}) == 40
    with pytest.raises(ConfigError, match="ANIMASTOR_LOG_LEVEL"):
        logs.level_from_env({"ANIMASTOR_LOG_LEVEL": "loud"})
    with pytest.raises(ConfigError, match="ANIMASTOR_LOG_FORMAT"):
        logs.format_from_env({"ANIMASTOR_LOG_FORMAT": "xml"})
    # A worker with a bad value stops at start-up, naming the variable (exit status 2).
    for key, value in (("ANIMASTOR_LOG_LEVEL", "loud"), ("ANIMASTOR_LOG_FORMAT", "xml")):
        proc = subprocess.run(
            celery_argv("worker", "-Q", CONTROL_QUEUE),
            env={**os.environ, key: value},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and key in proc.stderr, (proc.returncode, proc.stderr)


def test_json_fields_of_a_line_inside_a_task() -> None:
    record = logging.LogRecord("animastor.gate", logging.INFO, __file__, 1, "[COMMAND-GATE] %s ok", ("x",), None)
    kwargs = {"book_id": "b\u2028", "lane": "gpu.audio"}
    logs.on_task_prerun(task_id="t1", task=type("T", (), {"name": "animastor.gate"})(), kwargs=kwargs)
    try:
        inside = logs.JsonLines().format(record)
    finally:
        logs.on_task_postrun(task_id="t1")
    assert "\n" not in inside and "\u2028" not in inside  # one line, whatever an id holds
    obj = json.loads(inside)
    assert (obj["component"], obj["message"], obj["level"], obj["book"]) == (
        "COMMAND-GATE",
        "[COMMAND-GATE] x ok",
        "INFO",
        "b\u2028",
    )
    outside = json.loads(logs.JsonLines().format(record))
    assert "book" not in outside and outside["component"] == "COMMAND-GATE"  # no task, no context

    # A GPU job: the pair from its kwargs (its command_id is looked up in Postgres: the worker test above).
    job = {"book_id": "b1", "chapter_id": "ch1", "scene_id": "s1", "stage": "audio", "dispatch_id": "d1", "x": 1}
    assert logs.task_context(job) == {
        "book": "b1",
        "chapter": "ch1",
        "scene": "s1",
        "stage": "audio",
        "dispatch_id": "d1",
    }
    regenerate = logs.task_context({"book_id": "b1", "command_id": "c1", "stages": ["all"], "scenes": None})
    assert regenerate == {"book": "b1", "command_id": "c1"}


@pytest.mark.parametrize("form", ["text", "json"])
def test_a_traceback_with_a_lone_surrogate_is_written_cleaned(tmp_path: Path, form: str) -> None:
    """A plugin's exception whose text holds a lone surrogate (bytes decoded with `surrogateescape`), logged with
    its traceback: a UTF-8 log file refused the text line (a logging error in its place, the traceback lost), and
    the JSON line carried an escaped lone surrogate that strict JSON readers refuse."""
    path = tmp_path / "worker.log"
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logs.JsonLines() if form == "json" else logs.WithCommand(logging.Formatter("%(message)s")))
    logger = logging.getLogger(f"animastor.test.surrogate.{form}")
    logger.propagate, logger.handlers = False, [handler]
    try:
        raise ValueError("plugin said \udcff\x00 and gave up")
    except ValueError:
        logger.exception("[GENERATE] generator raised for %s", "s\ud800")
    finally:
        handler.close()
    text = path.read_text(encoding="utf-8")
    if form == "json":
        [line] = json_lines(text, "worker.log")
        assert line["message"] == "[GENERATE] generator raised for s\ufffd"
        assert "ValueError: plugin said \ufffd\ufffd and gave up" in line["exc_info"], line
    else:
        assert text.startswith("[GENERATE] generator raised for s\ufffd\nTraceback"), text
        assert "ValueError: plugin said \ufffd\ufffd and gave up" in text, text


def test_packaged_flower_settings_as_flower_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tornado's own config-file reader on the installed settings file: the auth rules hold there too."""
    from tornado.options import OptionParser

    def parse(**env: str) -> OptionParser:
        for key in [k for k in os.environ if k.startswith("ANIMASTOR_FLOWER_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        parser = OptionParser()
        parser.define("address", default="")
        parser.define("port", default=0, type=int)
        parser.define("max_tasks", default=0, type=int)
        parser.define("basic_auth", default=[], type=str, multiple=True)
        parser.parse_config_file(flower_settings.conf_path(), final=False)
        return parser

    options = parse(ANIMASTOR_FLOWER_BASIC_AUTH="ops:pa:ss,word", ANIMASTOR_FLOWER_PORT="6001")
    assert (options.address, options.port, options.basic_auth) == ("127.0.0.1", 6001, ["ops:pa:ss,word"])
    with pytest.raises(SystemExit) as refused:
        parse()
    assert refused.value.code == 2


def test_animastor_tasks_flower_refuses_without_credentials(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANIMASTOR_FLOWER_", "FLOWER_"))}
    for extra, expected in (
        ({}, "set ANIMASTOR_FLOWER_BASIC_AUTH=user:password"),
        ({"ANIMASTOR_FLOWER_BASIC_AUTH": ":only-a-password"}, "must be 'user:password'"),
    ):
        proc = subprocess.run(
            [*CLI, "flower"], env={**env, **extra}, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
        assert "refusing to start Flower" in proc.stderr and expected in proc.stderr, proc.stderr
        assert "only-a-password" not in proc.stdout + proc.stderr
