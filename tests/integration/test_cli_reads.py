"""The read commands of the CLI, run as a subprocess against the real stores (`--json` shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from animastor_tasks.flow import cancel as cancel_flow
from animastor_tasks.flow import regenerate as regenerate_flow

from .helpers import advertise, cli, make_book


def test_read_commands_speak_json(rt) -> None:
    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    advertise(rt, "gpu.audio", host="audio@box")
    regenerate_flow.regenerate(rt.ports, "b", ["all"])  # audio runs, image is BLOCKED (no consumer)

    status = json.loads(cli("status", "b", "--json").stdout)
    assert {c["stage"]: c["status"] for c in status["commands"]} == {"audio": "active", "image": "blocked"}
    image = next(c for c in status["commands"] if c["stage"] == "image")
    assert image["reason"] == "no_worker:image" and image["progress"]["dirty"] == 3

    queues = {q["queue"]: q for q in json.loads(cli("queues", "--json").stdout)}
    assert [c["hostname"] for c in queues["gpu.audio"]["consumers"]] == ["audio@box"]
    assert queues["gpu.audio"]["depth"] == 3 and queues["gpu.audio"]["in_flight"] == 3
    assert queues["gpu.image"]["consumers"] == [] and queues["gpu.image"]["start_worker"].endswith("--stage image")

    recent = json.loads(cli("commands", "b", "--json").stdout)
    assert {c["stage"] for c in recent} == {"audio", "image"} and all(c["age_seconds"] >= 0 for c in recent)

    assert json.loads(cli("layers", "show", "b", "--json").stdout) == {"audio": True, "image": True}


def test_read_commands_exit_2_on_bad_input(rt) -> None:
    done = cli("status", "no-such-book", "--json")
    assert done.returncode == 2 and "unknown book 'no-such-book'" in done.stderr
    done = cli("layers", "set", "no-such-book", "--disable", "image")
    assert done.returncode == 2


@pytest.mark.parametrize("book", ["no-such-book", "   ", "bad\x01id"])
def test_commands_of_a_book_that_is_not_one_exit_2(rt, book: str) -> None:
    """`commands BOOK` printed `[]` (exit 0) for an unknown book, where `status` says it is unknown."""
    done = cli("commands", book, "--json")
    assert done.returncode == 2, done.stdout
    assert "book_id" in done.stderr and "Traceback" not in done.stderr


def test_commands_of_an_argument_that_is_not_utf8_exit_2(rt) -> None:
    """A non-UTF-8 byte in argv reached the database driver as a lone surrogate: a traceback, no JSON."""
    done = subprocess.run(
        [sys.executable.encode(), b"-m", b"animastor_tasks.operator.cli", b"commands", b"bad\xff", b"--json"],
        capture_output=True,
        timeout=60,
        env=os.environ.copy(),
    )
    assert done.returncode == 2, done.stderr
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("status", "b", "--watch", "--interval", "nan"),
        ("status", "b", "--watch", "--interval", "inf"),
        ("queues", "--watch", "--interval", "nan"),
        ("regenerate", "b", "--stage", "audio", "--timeout", "nan"),
        ("regenerate", "b", "--stage", "audio", "--timeout", "0"),
        ("cancel", "b", "--timeout", "-1"),
        # Finite but past what a wait or a sleep takes: an OverflowError traceback, after the command was sent.
        ("regenerate", "b", "--stage", "audio", "--timeout", "1e300"),
        ("queues", "--watch", "--interval", "1e300"),
    ],
)
def test_seconds_that_are_not_a_positive_finite_number_are_usage_errors(rt, args: tuple[str, ...]) -> None:
    """`--interval nan` was a ValueError traceback; `--timeout nan` waited for ever; `--timeout -1` enqueued the
    command, then failed at once saying no control worker answered."""
    done = cli(*args)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and ("--interval" in done.stderr or "--timeout" in done.stderr)
    # Nothing was sent, at any priority (kombu keeps one list per priority step: `<queue>\x06\x16<step>`).
    assert not any(rt.redis.client.llen(name) for name in rt.redis.client.keys("animastor.control*"))


@pytest.mark.parametrize("args", [("status", "b"), ("queues",)])
def test_watch_and_json_together_are_refused(rt, args: tuple[str, ...]) -> None:
    """`--watch --json` printed the JSON once and exited 0: a script that meant to follow a book until its
    commands ended took the first look for the last."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    done = cli(*args, "--watch", "--json")
    assert done.returncode == 2 and "--watch" in done.stderr and "--json" in done.stderr, done
    assert done.stdout == ""


def test_layers_both_on_and_off_at_once_is_refused(rt) -> None:
    """`--enable audio --disable audio` turned audio off without a word."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    done = cli("layers", "set", "b", "--enable", "audio", "--disable", "audio")
    assert done.returncode == 2 and "audio" in done.stderr
    assert json.loads(cli("layers", "show", "b", "--json").stdout)["audio"] is True


def test_a_commands_age_is_never_negative_when_the_database_clock_runs_ahead(rt) -> None:
    """`age_seconds` is this host's clock against the database's `now()`: a CLI host a few seconds behind printed
    negative ages, which `commands.schema.json` (minimum 0) refuses."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    with rt.db.transaction() as conn:  # the database's clock 30 s ahead of this host's
        conn.execute("UPDATE commands SET created_at = now() + interval '30 seconds' WHERE book_id = 'b'")
    [row] = json.loads(cli("commands", "b", "--json").stdout)
    assert row["age_seconds"] == 0


def test_a_commands_limit_past_what_postgres_counts_is_a_usage_error(rt) -> None:
    """`--limit 99999999999999999999` passed click's range and failed in Postgres: a NumericValueOutOfRange
    traceback."""
    done = cli("commands", "--limit", "99999999999999999999")
    assert done.returncode == 2, done.stderr
    assert "--limit" in done.stderr and "Traceback" not in done.stderr


def test_status_shows_a_book_s_active_command_however_many_newer_ones_there_are(rt) -> None:
    """`status` read the book's 200 newest commands: a whole-book bulk command still at work behind 200 readers'
    single scenes vanished from it, and `status --watch` ended while its work went on."""
    from animastor_tasks.flow.status import status

    rt.catalog.import_book(make_book("b", chapters=1, scenes=3))
    advertise(rt, "gpu.audio", "gpu.image")
    bulk = regenerate_flow.regenerate(rt.ports, "b", ["audio"], priority="bulk")["commands"][0]["command_id"]
    for _ in range(200):
        regenerate_flow.regenerate(rt.ports, "b", ["image"], [["ch1", "s1"]], force=False, priority="interactive")
    with rt.db.transaction() as conn:  # the readers' commands have ended: only the bulk one works on
        conn.execute("UPDATE commands SET status = 'completed' WHERE stage = 'image'")
    shown = {c["command_id"]: c["status"] for c in status(rt.ports, "b")["commands"]}
    assert shown.get(bulk) == "active", f"the active bulk command is not shown among {len(shown)}"
    assert len(shown) == 201


def test_a_heartbeat_s_age_is_read_from_the_beat_not_from_this_shell_s_ttl(rt) -> None:
    """The age was the CLI's own presence TTL less the heartbeat's time left: a worker run with a TTL of 30 s that
    beat a moment ago showed -24 s beside a shell with the default 6 s."""
    from animastor_tasks.operator.queue_view import queue_overview

    advertise(rt, "gpu.audio", ttl=30.0)
    [audio] = [row for row in queue_overview(rt) if row["queue"] == "gpu.audio"]
    [consumer] = audio["consumers"]
    assert 0 <= consumer["heartbeat_age_seconds"] < 2, consumer


def test_a_queue_whose_worker_stopped_cleanly_shows_how_long_its_successor_is_awaited(rt) -> None:
    """During a restart the view said only "none - start one", not that the runtime waits for the successor, nor
    how long before the stage's commands are BLOCKED."""
    from animastor_tasks.operator.queue_view import queue_overview

    advertise(rt, "gpu.audio", "gpu.image", host="audio@box")
    rt.presence.heartbeat("audio@box", ["gpu.image"], 60.0, gone=["gpu.audio"])  # a clean stop of its audio consumer
    rows = {row["queue"]: row for row in queue_overview(rt)}
    grace = rt.settings.silent_worker_seconds
    assert rows["gpu.audio"]["consumers"] == []
    assert grace - 2 < rows["gpu.audio"]["successor_awaited_seconds"] <= grace
    assert rows["gpu.image"]["successor_awaited_seconds"] is None  # consumed: nothing awaited


def test_status_of_a_book_shows_its_progress_while_redis_does_not_answer(rt, monkeypatch) -> None:
    """Only the cancel flag is Redis's: during a Redis outage `status` exited 3 and showed nothing at all."""
    import socket

    rt.catalog.import_book(make_book("b", chapters=1, scenes=2))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("ANIMASTOR_REDIS_URL", f"redis://127.0.0.1:{port}/0")
    monkeypatch.setenv("ANIMASTOR_BROKER_URL", f"redis://127.0.0.1:{port}/0")
    done = cli("status", "b", "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["cancelled"] is False and len(shown["scenes"]) == 2, shown


def test_a_command_with_postgres_down_prints_one_error_line_not_the_pool_s_retries(rt, monkeypatch) -> None:
    """The CLI configured no logging: psycopg's pool printed each failed connection attempt (`error connecting in
    'pool-1'`, `reconnection attempt ... failed`), 3-7 lines of them, before the one `error:` line that says it all."""
    monkeypatch.setenv("ANIMASTOR_DATABASE_URL", "postgresql://postgres:pw@127.0.0.1:1/none")
    done = cli("status", "b", "--json")
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith("error: postgres unavailable at postgresql://postgres:***@127.0.0.1:1/"), done.stderr
    assert "pool" not in done.stderr.split("error: ", 1)[0] and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize(("command", "quiet"), [("status", True), ("metrics", False), ("worker", False)])
def test_only_the_cli_s_own_commands_quiet_the_pool(command: str, quiet: bool) -> None:
    """The exporter (and the Celery processes) log a store's retries as they always did."""
    import logging

    from click.testing import CliRunner

    from animastor_tasks.operator.cli import main

    pool = logging.getLogger("psycopg.pool")
    level = pool.level
    try:
        pool.setLevel(logging.NOTSET)
        assert CliRunner().invoke(main, [command, "--help"]).exit_code == 0
        assert (pool.level == logging.ERROR) is quiet
    finally:
        pool.setLevel(level)


def test_up_names_the_workers_of_this_stage_table_and_beat(rt, monkeypatch: pytest.MonkeyPatch) -> None:
    """It always said `worker --stage audio`: with a `tts` stage that command exits 2, and neither another stage's
    worker nor beat was named, so image commands were BLOCKED and no tick ran."""
    monkeypatch.setenv("ANIMASTOR_STAGES", '{"tts": {"media_type": "audio/wav"}, "art": {"media_type": "image/png"}}')
    up = cli("up")
    assert up.returncode == 0, up.stderr
    [ready] = [line for line in up.stdout.splitlines() if line.startswith("ready:")]
    assert "--stage tts" in ready and "--stage art" in ready and "animastor-tasks beat" in ready, ready
    assert "--stage audio" not in ready


def test_a_table_printed_to_a_pipe_keeps_its_cells_whole(rt) -> None:
    """Cut to 80 columns (`lighthouse-…`, `no_worker:ima…`): `commands | grep <book>` found nothing."""
    book = "a-book-whose-id-is-as-long-as-an-id-may-be-" + "x" * 157  # 200 characters
    rt.catalog.import_book(make_book(book, chapters=1, scenes=1))
    regenerate_flow.regenerate(rt.ports, book, ["audio", "image"])  # no worker: BLOCKED, its reason in the table
    cancel_flow.cancel(rt.ports, book, "r" * 1000)  # the longest reason, on every row
    done = cli("commands")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(book) == 2 and done.stdout.count("r" * 1000) == 2, done.stdout


def test_a_watch_into_a_pipe_prints_each_refresh_and_keeps_them_when_stopped(rt) -> None:
    """Rich's live view printed only its last frame as it ended: `timeout 5 animastor-tasks queues --watch > f`,
    stopped by SIGTERM, left the file empty."""
    watch = subprocess.Popen(
        [sys.executable, "-m", "animastor_tasks.operator.cli", "queues", "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        time.sleep(3.0)
    finally:
        watch.terminate()
        out, _ = watch.communicate(timeout=30)
    assert out.count("gpu.audio") >= 3 and "updated " in out, out


@pytest.mark.parametrize("skew", [-150, 150])
def test_a_commands_age_goes_by_the_database_clock_not_this_hosts(rt, tmp_path, monkeypatch, skew: int) -> None:
    """A CLI host whose clock is `skew` seconds off. Old code: a command 70 s old was 0 s old from a host 150 s
    behind and 220 s from one ahead, in `commands --json` and in the `status` table alike."""
    rt.catalog.import_book(make_book("b", chapters=1, scenes=1))
    advertise(rt, "gpu.audio")
    regenerate_flow.regenerate(rt.ports, "b", ["audio"])
    with rt.db.transaction() as conn:
        conn.execute("UPDATE commands SET created_at = now() - interval '70 seconds' WHERE book_id = 'b'")
    shifted = f"import time\n_real = time.time\ntime.time = lambda: _real() + {skew}\n"
    (tmp_path / "sitecustomize.py").write_text(shifted)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))

    [row] = json.loads(cli("commands", "b", "--json").stdout)
    table = cli("status", "b")

    assert 70 <= row["age_seconds"] < 130  # the host's clock says 0 (behind) or 220 (ahead)
    assert table.returncode == 0, table.stderr
    ages = [f" {m}:{s:02d}" for m, s in ((t // 60, t % 60) for t in range(70, 130))]
    assert any(age in table.stdout for age in ages), table.stdout  # its age column: 1:10 to 2:09
