"""The commands the control worker runs for the operator: `regenerate` and `cancel`, sent through the client
(`animastor_tasks/client.py`) and answered by the worker."""

from __future__ import annotations

import re
import shlex
from typing import Any
from urllib.parse import unquote

import click

from animastor_tasks.config import Settings
from animastor_tasks.domain.vocabulary import CommandStatus, Priority, no_worker_reason
from animastor_tasks.errors import AnimastorError, ConfigError, InvalidInput, StoreUnavailable
from animastor_tasks.flow import validate
from animastor_tasks.operator.options import WAIT, OutputUnwritable, emit


class SceneArg(click.ParamType):
    """CHAPTER/SCENE, each id as the regenerate task checks it. *Why:* `ch/` was published (and refused by the
    worker, or with the broker down left a resend to make), and `a/b/c` was read as chapter `a`, scene `b/c`. A
    type, so that click names the option in every refusal: raised in the command, `a/b/c` was a bare
    `Invalid value:`."""

    name = "CH/SC"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, str]:
        from animastor_tasks.domain.book import validate_id

        chapter, sep, scene = value.partition("/")
        if not sep or "/" in scene:
            self.fail(f"{value!r} must be CHAPTER/SCENE, one '/' (write a '/' inside an id as %2F)", param, ctx)
        try:
            return validate_id("chapter id", _decoded(chapter), error=InvalidInput), validate_id(
                "scene id", _decoded(scene), error=InvalidInput
            )
        except InvalidInput as err:
            self.fail(f"{value!r}: {err}", param, ctx)


def _decoded(half: str) -> str:
    """One id of --scene, percent-decoded strictly. *Why:* `a%ZZ` was kept as written and `%FF` became U+FFFD:
    another scene than the one meant, or none, named without a word."""
    if re.search(r"%(?![0-9A-Fa-f]{2})", half):
        raise InvalidInput(f"{half!r}: a '%' starts an escape of two hex digits (write a '%' inside an id as %25)")
    try:
        return unquote(half, errors="strict")
    except UnicodeDecodeError:
        raise InvalidInput(f"{half!r}: its escapes are not UTF-8") from None


@click.command()
@click.argument("book_id")
@click.option("--stage", "stages", multiple=True, required=True, help="audio, image, ... or all")
@click.option("--scene", "scenes", multiple=True, type=SceneArg(), help="Only these scenes (default: whole book).")
@click.option("--command-id", default=None, help="A UUID; resending the same request with it is a no-op.")
@click.option("--no-force", is_flag=True, help="Skip scenes whose ready output has the same inputs.")
@click.option(
    "--priority",
    type=click.Choice([str(p) for p in Priority]),
    default=None,
    help="Who gets a free GPU slot first, and on a Redis broker which command the control workers take first"
    " (default: normal).",
)
@click.option("--timeout", default=30.0, show_default=True, type=WAIT, help="Seconds to wait for the control worker.")
@click.option("--json", "as_json", is_flag=True)
def regenerate(
    book_id: str,
    stages: tuple[str, ...],
    scenes: tuple[tuple[str, str], ...],
    command_id: str | None,
    no_force: bool,
    priority: str | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Ask for work: one command per stage (enqueues animastor.regenerate)."""
    import uuid

    from animastor_tasks.client import Client

    # Checked here, as the task would, so that bad input exits 2 with nothing published.
    settings = Settings.from_env()
    validate.book_id(book_id)
    picked = list(scenes) or None
    known = settings.registry.names()
    if unknown := [s for s in stages if s != "all" and s not in known]:
        raise click.BadParameter(f"unknown stage {unknown[0]!r} (known: {', '.join(known)}, all)", param_hint="--stage")
    # Made here, not by the client, so that an answer that did not come can say how to ask again safely.
    request_id = str(uuid.uuid4()) if command_id is None else validate.request_id(command_id)
    client = Client(settings, timeout=timeout)
    try:
        result = client.regenerate(
            book_id, list(stages), picked, command_id=request_id, force=not no_force, priority=priority
        )
    except (InvalidInput, ConfigError):
        raise  # refused: nothing was written
    except (AnimastorError, KeyboardInterrupt):
        # No answer, or Ctrl-C while waiting (the message may be queued, or have run): a retry with a new id would
        # make a second command, and with force stop the first one's jobs. The same id is a resend, never a second.
        click.echo(f"note: to ask again, resend with --command-id {request_id} (a resend is never a second command)",
                   err=True)  # fmt: skip
        raise
    finally:
        client.close()

    def human(d: dict[str, Any]) -> None:
        """One line per command, and what --json says beside them: why one is BLOCKED (its only cause, no live
        consumer, is its reason), and that the answer is a resend's. *Why:* both were silent here."""
        for c in d["commands"]:
            n = len(c["targets"]) if isinstance(c["targets"], list) else c["targets"]
            click.echo(f"{c['command_id']}  {c['stage']:<8} {c['status']:<10} {n} scene(s)")
            if c["status"] == CommandStatus.BLOCKED:
                click.echo(f"  {no_worker_reason(c['stage'])} - start a worker: animastor-tasks worker --stage"
                           f" {c['stage']}, then regenerate again without --command-id (a blocked command is never"
                           " retried)")  # fmt: skip
        for s in d["skipped"]:
            click.echo(f"skipped {s['stage']}: {s['reason']}")
        if d.get("replayed"):
            click.echo("(resent: this command_id was already sent; nothing new was created)")

    try:
        emit(result, as_json, human)
    except OutputUnwritable:
        made = ", ".join(c["command_id"] for c in result["commands"]) or "none"
        click.echo(f"note: the request was answered (commands: {made}); to read the answer again, resend with"
                   f" --command-id {request_id} (a resend is never a second command)", err=True)  # fmt: skip
        raise


@click.command()
@click.argument("book_id")
@click.option(
    "--reason",
    default=None,
    help="Why, kept on the commands it ends and shown by `commands` and `status`: one line of at most"
    f" {validate.MAX_REASON_CHARS:,} characters, with no control character (tab, ESC, line break), U+2028/U+2029,"
    " bidi control or BOM.",
)
@click.option("--timeout", default=30.0, show_default=True, type=WAIT, help="Seconds to wait for the control worker.")
@click.option("--json", "as_json", is_flag=True)
def cancel(book_id: str, reason: str | None, timeout: float, as_json: bool) -> None:
    """Stop All for a book (enqueues animastor.cancel)."""
    from animastor_tasks.client import Client

    # Checked here, as the task would, so that bad input exits 2 with nothing published. *Why:* with the broker
    # down, `cancel $'a\tb'` exited 3 and asked for the same refused request to be sent again.
    validate.book_id(book_id)
    validate.reason(reason)
    client = Client(timeout=timeout)
    try:
        result = client.cancel(book_id, reason)
    except StoreUnavailable as err:
        again = f"send `{shlex.join(_cancel_argv(book_id, reason))}` again"
        if err.store == "postgres":
            # Only the control worker's flow reads Postgres, and its Stop All sets the Redis flag before any error of
            # Postgres leaves it (flow/cancel.py). *Why:* a bare `error: postgres unavailable` read as nothing done.
            click.echo(f"note: the cancel flag is set: the book's running jobs stop and none starts; {again} once"
                       " Postgres is back, to end its commands and release their scenes", err=True)  # fmt: skip
        else:  # the flag's own store, or the way to the worker or back: it may or may not have been set
            click.echo(f"note: the Stop All may not have been applied; {again} once {err.store} is back", err=True)
        raise
    finally:
        client.close()
    emit(
        result,
        as_json,
        lambda d: click.echo(
            f"cancelled {d['book_id']!r}: {len(d['cancelled_commands'])} command(s), {d['released']} pair(s) released"
        ),
    )


def _cancel_argv(book_id: str, reason: str | None) -> list[str]:
    """The command line that sends this Stop All again, its reason kept (and `--` before a book id that reads as
    an option). *Why:* the resend it suggested dropped `--reason`, and the commands it ended had none."""
    reason_opt = ["--reason", reason] if reason is not None else []
    return ["animastor-tasks", "cancel", *reason_opt, *(["--"] if book_id.startswith("-") else []), book_id]


COMMANDS = (regenerate, cancel)
