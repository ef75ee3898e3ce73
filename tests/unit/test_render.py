"""The operator's views rendered to text (rich `Console(record=True)`): the scene grid, rate and
ETA, and a queue depth that cannot be read shown as `?`, never 0."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from rich.console import Console

from animastor_tasks.adapters.broker_probe import passive_depths
from animastor_tasks.operator import render

STATES = ["ready", "generating", "pending", "dirty", "failed"]


def text_of(renderable: Any, width: int = 140) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


def book(chapters: int, scenes: int, stages: tuple[str, ...] = ("audio", "image")) -> dict[str, Any]:
    rows = [
        {
            "chapter_id": f"ch{c}",
            "scene_id": f"s{s}",
            "stages": {st: {"state": STATES[(c + s + i) % 5], "artifact": None} for i, st in enumerate(stages)},
        }
        for c in range(1, chapters + 1)
        for s in range(1, scenes + 1)
    ]
    progress = {"total": 20, "dirty": 0, "pending": 6, "generating": 2, "ready": 10, "failed": 2}
    progress |= {"released": 0, "released_reasons": {}}
    command = {
        "command_id": "0123456789abcdef",
        "stage": "audio",
        "status": "active",
        "reason": None,
        "created_at": time.time() - 65,
        "progress": progress,
    }
    return {"book_id": "b", "cancelled": False, "commands": [command], "scenes": rows}


def test_status_shows_one_cell_per_scene_and_stage() -> None:
    data = book(chapters=4, scenes=5)
    data["scenes"][0]["stages"]["image"] = {"state": "failed", "artifact": None}
    out = text_of(render.status_view(data))
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("chapter"))
    assert "audio" in header and "image" in header
    ch1 = next(line for line in lines if line.startswith("ch1 "))
    audio, image = ch1.split()[1:3]
    expected_audio = "".join(render.CELLS[STATES[(1 + s) % 5]][0] for s in range(1, 6))
    assert audio == expected_audio and len(image) == 5 and image[0] == "✗"
    assert "scenes (20)" in out
    assert "audio: ● ready 4" in out and "14/20" not in out  # done = ready + failed
    assert "12/20" in out and "0123456" in out and "1:05" in out
    assert "rate" not in out  # rate and ETA are for --watch


def test_status_says_why_pairs_failed_the_first_few_in_reading_order() -> None:
    data = book(chapters=3, scenes=5, stages=("audio",))
    for scene in data["scenes"]:
        scene["stages"]["audio"] = {"state": "ready", "artifact": None, "error": None}
    failed = data["scenes"][: render.FAILURES_SHOWN + 2]
    for i, scene in enumerate(failed):
        scene["stages"]["audio"] = {"state": "failed", "artifact": None, "error": f"backend said\nno {i}"}
    failed[0]["stages"]["audio"]["error"] = None  # failed before errors were kept
    out = text_of(render.status_view(data))
    assert f"failed ({render.FAILURES_SHOWN + 2})" in out
    assert "ch1/s1 audio: (no error recorded)" in out and "ch1/s2 audio: backend said no 1" in out
    assert f"no {render.FAILURES_SHOWN - 1}" in out and f"no {render.FAILURES_SHOWN}" not in out
    assert "(+2 more: status --json lists every one)" in out
    for scene in data["scenes"]:
        scene["stages"]["audio"]["state"] = "ready"
    assert "failed (" not in text_of(render.status_view(data))


def test_big_book_gets_one_wrapped_strip_per_stage() -> None:
    data = book(chapters=render.CHAPTER_ROWS_MAX + 16, scenes=25)
    out = text_of(render.status_view(data), width=100)
    assert "scenes (1000)" in out
    assert not any(line.startswith("ch1 ") for line in out.splitlines())
    glyphs = set("".join(g for g, _ in render.CELLS.values()))
    cells = sum(1 for ch in out if ch in glyphs) - sum(1 for ch in out.split("scenes (1000)")[0] if ch in glyphs)
    legend = sum(1 for line in out.splitlines() if line.startswith(("audio:", "image:")) for ch in line if ch in glyphs)
    assert cells - legend == 2000  # every scene of both stages, nothing cut off
    assert max(len(line) for line in out.splitlines()) <= 100


def test_watch_shows_rate_and_eta() -> None:
    data = book(chapters=1, scenes=3)
    meter = render.RateMeter(window=60)
    meter.observe(data, now=100.0)
    assert meter.rate("0123456789abcdef") is None
    data["commands"][0]["progress"]["ready"] = 14  # 4 more done in 8 s: 0.5/s, 4 left: 8 s
    meter.observe(data, now=108.0)
    out = text_of(render.status_view(data, meter))
    assert "0.50/s" in out and "0:08" in out
    data["commands"][0]["status"] = "completed"
    ended = text_of(render.status_view(data, meter))
    assert "done" in ended and "0.50/s" not in ended  # an ended command's counts move with later ones: no rate


def test_rate_window_forgets_old_samples() -> None:
    meter = render.RateMeter(window=10)
    data = book(chapters=1, scenes=1)
    for t, ready in [(0, 0), (5, 10), (20, 11), (30, 12)]:
        data["commands"][0]["progress"]["ready"] = ready
        meter.observe(data, now=float(t))
    rate = meter.rate("0123456789abcdef")
    assert rate is not None and rate < 0.2  # the burst at t=5 is outside the window


def queue_row(depth: int | None) -> dict[str, Any]:
    return {
        "queue": "gpu.audio",
        "stage": "audio",
        "consumers": [{"hostname": "audio@box", "heartbeat_age_seconds": 1.5}],
        "broker_consumers": None,
        "depth": depth,
        "in_flight": 2,
        "lane_limit": 4,
        "books_waiting": 5,
        "breaker": "closed",
        "deferred": {"capacity": 3, "idempotent": 0},
        "start_worker": "animastor-tasks worker --stage audio",
    }


def depth_cell(out: str) -> str:
    row = next(line for line in out.splitlines() if "gpu.audio" in line)
    return row.split("│")[4].strip()


def test_unreadable_queue_depth_shows_question_mark_not_zero() -> None:
    assert depth_cell(text_of(render.queues_table([queue_row(None)]))) == "?"
    assert depth_cell(text_of(render.queues_table([queue_row(0)]))) == "0"
    out = text_of(render.queues_table([queue_row(7)]))
    assert depth_cell(out) == "7" and "idempotent" not in out
    row = next(line for line in out.splitlines() if "gpu.audio" in line)
    assert row.split("│")[7].strip() == "5"  # books waiting for the lane, beside its limit
    # Farm-wide, once under the table: a column repeated the same totals on every queue's row.
    two = text_of(render.queues_table([queue_row(7), {**queue_row(1), "queue": "gpu.image", "stage": "image"}]))
    assert two.count("capacity=3") == 1 and "deferred pairs: capacity=3" in two


def test_a_queue_awaiting_its_workers_successor_says_how_long_before_its_commands_are_blocked() -> None:
    row = {**queue_row(0), "consumers": [], "successor_awaited_seconds": 12.5}
    out = text_of(render.queues_table([row]), width=400)
    assert "a successor is awaited 12.5s more, then its commands are BLOCKED" in out
    gone = text_of(render.queues_table([{**row, "successor_awaited_seconds": None}]), width=400)
    assert "awaited" not in gone and "start one" in gone


def test_queue_depths_unknown_when_the_broker_is_down() -> None:
    depths = passive_depths("redis://127.0.0.1:1/0", ["gpu.audio", "gpu.image"])
    assert depths == {"gpu.audio": None, "gpu.image": None}


def commands_text(**row: Any) -> str:
    """The `commands` table of one command (these fields over a plain one), as text."""
    console = Console(record=True, width=160, color_system=None)
    plain = {"command_id": "0123456789abcdef", "book_id": "b", "stage": "audio", "status": "active"}
    render.show_commands([{**plain, "reason": None, "age_seconds": 3.0, **row}], console=console)
    return console.export_text()


def test_ids_and_reasons_are_shown_as_written_never_read_as_markup() -> None:
    """Chapter ids, book ids and reasons may hold brackets (the book format allows them): passed to a table as
    str they were read as Rich markup, so `ch[/1]` crashed `status` with a MarkupError and `[red]` vanished."""
    data = book(chapters=1, scenes=2)
    for scene in data["scenes"]:
        scene["chapter_id"] = "ch[/1]"
    assert "ch[/1]" in text_of(render.status_view(data))
    out = commands_text(book_id="[red]b", status="cancelled", reason="stop [/]", progress={"total": 2, "ready": 1})
    assert "[red]b" in out and "stop [/]" in out


def test_a_negative_limit_or_interval_is_bad_input_not_a_traceback() -> None:
    """`commands --limit -1` reached Postgres (a DataError traceback, exit 1) and `--interval -1` time.sleep."""
    from click.testing import CliRunner

    from animastor_tasks.operator.cli import main

    for args in (
        ["commands", "--limit", "-1"],
        ["status", "b", "--watch", "--interval", "-1"],
        ["queues", "--interval", "0"],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "Invalid value" in result.output, (args, result.output)


def test_gpu_ids_that_would_share_a_gpu_or_name_none_are_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--gpus 0,1,` started three pool children and two of them shared GPU 0; `--gpus 0,0` put two on one GPU."""
    from click.testing import CliRunner

    from animastor_tasks.operator import process_commands
    from animastor_tasks.operator.cli import main

    started: list[tuple[str, ...]] = []
    monkeypatch.setattr(process_commands, "_exec_celery", lambda *args: started.append(args))
    monkeypatch.delenv("ANIMASTOR_GPU_IDS", raising=False)
    for gpus in ("0,1,", ",", "0,0", "0, 0", "0 1", ""):
        result = CliRunner().invoke(main, ["worker", "--stage", "audio", "--gpus", gpus])
        assert result.exit_code == 2 and "Invalid value for '--gpus'" in result.output, (gpus, result.output)
    assert started == []
    result = CliRunner().invoke(main, ["worker", "--stage", "audio", "--gpus", " 3, GPU-8f2a ,MIG-1c/0"])
    assert result.exit_code == 0, result.output
    [argv] = started
    assert argv[argv.index("-c") + 1] == "3"
    assert os.environ["ANIMASTOR_GPU_IDS"] == "3,GPU-8f2a,MIG-1c/0"


def test_celery_options_that_undo_the_workers_own_are_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Passed on last, they won: `-Q animastor.control` made a control worker of `--stage audio`, `-X gpu.audio` one
    consuming nothing, `--gpus 0,1 -c 4` two processes on each GPU."""
    from click.testing import CliRunner

    from animastor_tasks.operator import process_commands
    from animastor_tasks.operator.cli import main

    started: list[tuple[str, ...]] = []
    monkeypatch.setattr(process_commands, "_exec_celery", lambda *args: started.append(args))
    monkeypatch.delenv("ANIMASTOR_GPU_IDS", raising=False)
    for extra in (
        ["-Q", "animastor.control"],
        ["-Qgpu.image"],
        ["--queues=x"],
        ["-X", "gpu.audio"],
        ["--exclude-queues", "q"],
    ):
        for own in (["--stage", "audio"], []):
            result = CliRunner().invoke(main, ["worker", *own, *extra])
            assert result.exit_code == 2 and "the worker command sets" in result.output, (extra, result.output)
    for extra in (["-c", "4"], ["-c4"], ["--concurrency=4"], ["--autoscale=4,1"], ["--autoscale", "4,1"]):
        result = CliRunner().invoke(main, ["worker", "--stage", "audio", "--gpus", "0,1", *extra])
        assert result.exit_code == 2 and "a process per GPU" in result.output, (extra, result.output)
    assert started == []
    result = CliRunner().invoke(
        main, ["worker", "--stage", "audio", "-c", "2", "-P", "prefork", "--max-tasks-per-child=9"]
    )
    assert result.exit_code == 0, result.output
    [argv] = started  # a GPU worker's own -c without --gpus (CPU inference) is still the operator's to give
    assert argv[-5:] == ("-c", "2", "-P", "prefork", "--max-tasks-per-child=9")


def test_gpu_ids_without_a_stage_are_refused_rather_than_start_a_control_worker(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`worker --gpus 0,1` with `--stage` forgotten started the control worker on the GPU host, the ids ignored."""
    from click.testing import CliRunner

    from animastor_tasks.operator import process_commands
    from animastor_tasks.operator.cli import main

    started: list[tuple[str, ...]] = []
    monkeypatch.setattr(process_commands, "_exec_celery", lambda *args: started.append(args))
    result = CliRunner().invoke(main, ["worker", "--gpus", "0,1"])
    assert result.exit_code == 2 and "--stage" in result.output, result.output
    assert started == []


def test_a_command_made_by_a_clock_ahead_of_this_host_is_zero_old_not_negative() -> None:
    """`created_at` is the database's clock: 5 s ahead of the CLI host, the age read `-1:59:55`."""
    data = book(chapters=1, scenes=1)
    data["commands"][0]["created_at"] = time.time() + 5
    out = text_of(render.commands_table(data))
    assert " 0:00" in out and "-1:" not in out


def test_a_watch_rides_out_a_store_that_fails_a_refresh() -> None:
    """A refresh that met a store blip (the first transaction on a pooled connection a Postgres restart had closed)
    ended `status --watch` with exit 3; it now shows the error and refreshes again."""
    from animastor_tasks.errors import StoreUnavailable

    active, done = book(chapters=1, scenes=2), book(chapters=1, scenes=2)
    done["commands"][0]["status"] = "completed"
    blip = StoreUnavailable("postgres", "postgresql://db/x", "server closed the connection")
    answers: list[Any] = [active, blip, done]

    def fetch() -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    console = Console(record=True, width=120, force_terminal=False)
    render.show_status(fetch, watch=True, interval=0.01, console=console)
    assert answers == []  # refreshed past the failure, to the end
    assert "postgres unavailable" in render._refresh_failed(blip).plain  # what the view shows meanwhile

    rows: list[Any] = [[], StoreUnavailable("redis", "redis://r/0", "connection refused"), KeyboardInterrupt()]

    def queues() -> Any:
        answer = rows.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    render.watch_queues(queues, interval=0.01, console=console)
    assert rows == []


def test_commands_counts_a_failed_target_as_done_as_status_does() -> None:
    """`commands` showed `8/10` for a command whose last two targets failed (it had ended `failed`), where
    `status` showed `10/10`: the same command read as unfinished in one view and done in the other."""
    out = commands_text(status="failed", progress={"total": 10, "ready": 8, "failed": 2})
    assert "10/10" in out and "2 failed" in out


@pytest.mark.parametrize("colours", ["standard", "256"])
def test_an_ended_command_is_faint_not_a_grey_a_dark_theme_hides(colours: str) -> None:
    """Greyed with `grey50` and its bar's track `grey30`: on a 16-colour terminal they became bright black and black,
    which dark themes (Solarized's bright black is its background) show as nothing. Faint (SGR 2) is drawn from the
    terminal's own foreground on any theme."""
    data = book(1, 2)
    data["commands"][0]["status"] = "completed"
    console = Console(record=True, width=140, color_system=colours, force_terminal=True)
    console.print(render.status_view(data, render.RateMeter()))
    ansi = console.export_text(styles=True)
    row = next(line for line in ansi.splitlines() if "01234567" in line)
    assert "\x1b[2m" in row, row
    assert not any(code in row for code in ("\x1b[90m", "\x1b[30m", "38;5;244", "38;5;239")), row
