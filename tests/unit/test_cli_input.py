"""The CLI refuses input it cannot act on with exit 2 before it reaches a store or the broker (nothing listens
at the URLs below: a command that tried would exit 3, or wait)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from animastor_tasks.operator.cli import main

NOWHERE = {
    "ANIMASTOR_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none",
    "ANIMASTOR_REDIS_URL": "redis://127.0.0.1:1/0",
    "ANIMASTOR_BROKER_URL": "redis://127.0.0.1:1/0",
}


@pytest.fixture(autouse=True)
def _no_local_stores(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ANIMASTOR_LOCAL_DIR", str(tmp_path / "none"))


@pytest.mark.parametrize("wait", ["nan", "inf", "-inf", "1e400", "-1", "soon"])
def test_a_lock_wait_that_is_no_finite_number_of_seconds_is_refused(wait: str) -> None:
    """`nan`, `inf` and `1e400` passed click's FloatRange: the migration's deadline was never reached, so behind a
    transaction left open it waited for ever instead of exiting 3."""
    result = CliRunner().invoke(main, ["db", "migrate", "--lock-wait", wait], env=NOWHERE)
    assert result.exit_code == 2 and "--lock-wait" in result.output, (wait, result.output)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--command-id", "nope"], "command_id"),
        (["--command-id", "{8c4f3f6e-7c2a-4a8e-9d0b-2f1e6a5b4c3d}"], "command_id"),
        (["--scene", "ch/"], "--scene"),
        (["--scene", "/sc"], "--scene"),
        (["--scene", "ch1/ %0A"], "--scene"),
        # A second '/' was taken as part of the scene id (chapter `a`, scene `b/c`): a '/' in an id is %2F.
        (["--scene", "a/b/c"], "%2F"),
        # Read as written (`a%ZZ`), or as U+FFFD (`%FF`, no UTF-8): another scene than the one meant, or none.
        (["--scene", "a%ZZ/b"], "%25"),
        (["--scene", "ch1/50%"], "%25"),
        (["--scene", "ch1/%FF"], "UTF-8"),
        (["--stage", "video"], "video"),
    ],
)
def test_regenerate_refuses_its_own_bad_input_before_it_publishes(args: list[str], needle: str) -> None:
    """Each was published (with the broker down: "resend with --command-id nope", exit 3)."""
    argv = ["regenerate", "b1", "--timeout", "1", *(["--stage", "audio"] if "--stage" not in args else []), *args]
    result = CliRunner().invoke(main, argv, env=NOWHERE)
    assert result.exit_code == 2, (args, result.output)
    assert needle in result.output and "resend" not in result.output, result.output


def test_regenerate_with_good_input_goes_on_to_the_broker() -> None:
    """The checks above refuse only what is wrong: a good request reaches the (absent) broker, exit 3."""
    argv = ["regenerate", "b1", "--stage", "all", "--scene", "ch%2F1/sc 1", "--timeout", "1"]
    argv += ["--command-id", "8C4F3F6E-7C2A-4A8E-9D0B-2F1E6A5B4C3D"]
    result = CliRunner().invoke(main, argv, env=NOWHERE)
    assert result.exit_code == 3, result.output


@pytest.mark.parametrize("book", ["", "   ", "bad\x01id"])
def test_regenerate_refuses_a_book_id_that_is_no_id_before_it_publishes(book: str) -> None:
    """Stages, scenes and --command-id were checked here, the book id not: `regenerate "" --stage audio` was
    published (with the broker down: exit 3 and "resend with --command-id ...")."""
    result = CliRunner().invoke(main, ["regenerate", book, "--stage", "audio", "--timeout", "1"], env=NOWHERE)
    assert result.exit_code == 2, (book, result.output)
    assert "book_id" in result.output and "resend" not in result.output, result.output


def test_layers_set_says_what_it_does_and_what_its_options_take() -> None:
    """`layers set --help` had no description, and --enable/--disable no help."""
    result = CliRunner().invoke(main, ["layers", "set", "--help"], env=NOWHERE)
    assert result.exit_code == 0, result.output
    summary, _, options = result.output.partition("Options:")
    assert "Turn stages on or off" in summary, result.output
    for flag in ("--enable", "--disable"):
        [line] = [line for line in options.splitlines() if line.strip().startswith(flag)]
        assert line.split("STAGE", 1)[1].strip(), result.output  # a help text after the metavar


@pytest.mark.parametrize("scene", ["a/b/c", "ch1", "ch/", "a%ZZ/b", "ch1/%FF"])
def test_every_scene_refusal_names_the_option(scene: str) -> None:
    """`a/b/c` and `ch1` said a bare `Invalid value:`, an escape `Invalid value for --scene:`: which argument was
    wrong, among several, was left to guess."""
    result = CliRunner().invoke(main, ["regenerate", "b1", "--stage", "audio", "--scene", scene], env=NOWHERE)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--scene': {scene!r}" in result.output, result.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["a\tb"], "book_id"),
        ([""], "book_id"),
        (["b1", "--reason", "x\x1b[31m"], "reason: must not contain U+001B"),
        (["b1", "--reason", "two\nlines"], "reason: must not contain U+000A"),
        (["b1", "--reason", "x" * 1_001], "reason: must be at most 1000 characters"),
    ],
)
def test_cancel_refuses_its_own_bad_input_before_it_publishes(args: list[str], needle: str) -> None:
    """With the broker down each exited 3 and said to send the same refused Stop All again."""
    result = CliRunner().invoke(main, ["cancel", "--timeout", "1", *args], env=NOWHERE)
    assert result.exit_code == 2, (args, result.output)
    assert needle in result.output and "again" not in result.output, result.output


@pytest.mark.parametrize(
    ("args", "again"),
    [
        (["b1", "--reason", "disk full"], "animastor-tasks cancel --reason 'disk full' b1"),
        (["b1", "--reason", "it's late"], """animastor-tasks cancel --reason 'it'"'"'s late' b1"""),
        (["b1"], "animastor-tasks cancel b1"),
        (["--reason", "x", "--", "-b1"], "animastor-tasks cancel --reason x -- -b1"),
    ],
)
def test_a_cancel_the_broker_did_not_take_says_how_to_send_it_again_reason_and_all(args: list[str], again: str) -> None:
    """The line to send it again dropped `--reason`: the commands the resend ended had none."""
    result = CliRunner().invoke(main, ["cancel", "--timeout", "1", *args], env=NOWHERE)
    assert result.exit_code == 3, result.output
    assert f"send `{again}` again" in result.output, result.output


@pytest.fixture
def exec_celery(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """What `worker` would have run: never this test process replaced by Celery."""
    from animastor_tasks.operator import process_commands

    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(process_commands, "_exec_celery", lambda *args: calls.append(args))
    return calls


def test_a_worker_takes_one_stage(exec_celery: list[tuple[str, ...]]) -> None:
    """`--stage audio --stage image` started an image-only worker: click kept the last one, without a word."""
    result = CliRunner().invoke(main, ["worker", "--stage", "audio", "--stage", "image"], env=NOWHERE)
    assert result.exit_code == 2 and exec_celery == [], result.output
    assert "Invalid value for '--stage': given 2 times (audio, image)" in result.output, result.output
    hint = "run one worker per stage: `animastor-tasks worker --stage audio` and `animastor-tasks worker --stage image`"
    assert hint in " ".join(result.output.split()), result.output
    one = CliRunner().invoke(main, ["worker", "--stage", "audio"], env=NOWHERE)
    assert one.exit_code == 0, one.output
    [args] = exec_celery
    assert args[args.index("-Q") + 1] == "gpu.audio" and args[args.index("-n") + 1] == "audio@%h", args
