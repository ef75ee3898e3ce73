"""The operator's command line: `animastor-tasks ...`.

Exit codes: 0 ok, 2 bad input, 3 a store or the broker is unavailable (named, with its
URL and the password hidden), 1 anything else. Read commands take `--json`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from animastor_tasks.config import Settings
from animastor_tasks.errors import AnimastorError, ConfigError, InvalidInput, StoreUnavailable
from animastor_tasks.operator import control_commands, process_commands
from animastor_tasks.operator.options import INTERVAL, LOCK_WAIT, emit, to_stdout
from animastor_tasks.worker import tracing

if TYPE_CHECKING:
    from animastor_tasks.worker.wiring import Wiring

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def _wired() -> Wiring:
    """This command's adapters, built once from the environment."""
    from animastor_tasks.worker.wiring import build

    return build(Settings.from_env())


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class Main(click.Group):
    """Translates our errors into exit codes instead of tracebacks."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (InvalidInput, ConfigError) as err:
            _fail(str(err), 2)
        except StoreUnavailable as err:
            _fail(str(err), 3)
        except AnimastorError as err:
            _fail(str(err), 1)


@click.group(cls=Main)
@click.version_option(package_name="animastor-tasks")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Command-only GPU job orchestration: books, commands, queues and workers."""
    # Refused here for every command, as workers and beat refuse it (exit 2, the variable named). *Why:*
    # `ANIMASTOR_OTEL=2` stopped them but not the CLI: `queues` answered and `metrics` served on.
    tracing.wanted()
    if ctx.invoked_subcommand not in _RUNS_ON:
        # A store down is said once, by the `error:` line: psycopg's pool printed each of its retries before it.
        logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    ctx.meta[process_commands.LOCAL_ENV_FILLED] = _load_local_env()


#: The commands that become Celery processes or serve until stopped: what they log is theirs, a store's retries too.
_RUNS_ON = frozenset({"worker", "beat", "flower", "metrics", "demo", "dev-inference-server"})


def _load_local_env() -> list[str]:
    """After `animastor-tasks up` started local stores, later commands find them without a `source`; but none of
    them where the environment names, otherwise, a store they would set. *Why:* filled in one by one, a command
    (or a worker) that named only its Redis took the local broker and database beside it: it published where no
    worker of that Redis listened, and a worker heartbeat to one Redis while it consumed another's broker."""
    from animastor_tasks.dev.local_dir import default_data_dir

    if not default_data_dir().exists():
        return []
    from animastor_tasks.dev import stores as devstack

    local = devstack.local_env()
    named = sorted(key for key, value in local.items() if os.environ.get(key, value) != value)
    if named:
        click.echo(f"note: the local stores of `animastor-tasks up` are not used: {', '.join(named)} set", err=True)
        return []
    for key, value in local.items():
        os.environ.setdefault(key, value)
    return list(local)


# -- stores ------------------------------------------------------------------------------
@main.group()
def db() -> None:
    """Postgres schema."""


@db.command("migrate")
@click.option(
    "--lock-wait",
    type=LOCK_WAIT,
    help="Seconds db migrate waits for the migration lock (another migrate's), and each migration tries for its"
    " table locks (a second at a time), before it gives up with exit 3 [default: 60].",
)
def db_migrate(lock_wait: float | None) -> None:
    """Apply pending migrations (idempotent)."""
    from animastor_tasks.adapters.postgres.migrations import LOCK_WAIT_SECONDS, migrate

    applied = migrate(_wired().db, LOCK_WAIT_SECONDS if lock_wait is None else lock_wait)
    click.echo(f"applied: {', '.join(applied)}" if applied else "database is up to date")


# -- books and layers ------------------------------------------------------------------------
@main.group()
def book() -> None:
    """Books: import and re-import."""


MAX_BOOK_BYTES = 256 << 20  # a book of 50,000 scenes is about 50 MB


def _read_book_file(path: Path) -> bytes:
    """At most one byte more than a book may be. *Why:* read whole, a wrong path (`/dev/zero`, a disk image) or an
    endless standard input took the host's memory until the kernel killed a process, maybe not this one."""
    if str(path) == "-":
        return sys.stdin.buffer.read(MAX_BOOK_BYTES + 1)
    with path.open("rb") as handle:
        return handle.read(MAX_BOOK_BYTES + 1)


@book.command("import")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def book_import(path: Path, as_json: bool) -> None:
    """Import (or re-import) a book from a JSON file ('-' reads standard input). Queues nothing."""
    from animastor_tasks.domain.book_json import parse_book_json
    from animastor_tasks.errors import InvalidBook

    try:
        raw = _read_book_file(path)
    except OSError as err:
        raise InvalidBook(f"cannot read {str(path)!r}: {err.strerror}") from err
    if len(raw) > MAX_BOOK_BYTES:
        raise InvalidBook(f"{str(path)!r} is larger than {MAX_BOOK_BYTES >> 20} MiB, the most a book file may be")
    rt = _wired()
    summary = rt.catalog.import_book(parse_book_json(raw))
    if summary.removed_jobs:  # their scenes are gone: their jobs stop rather than run on into a refused commit
        from animastor_tasks.flow.cancel import let_go

        try:
            let_go(rt.ports, summary.book_id, summary.removed_jobs, book_goes_on=True)
        except StoreUnavailable as err:
            click.echo(f"warning: the jobs of removed scenes run on until their commit is refused: {err}", err=True)
    data = summary.public()
    emit(
        data,
        as_json,
        lambda d: click.echo(
            f"{'imported' if d['created'] else 're-imported'} {d['book_id']!r}: {d['scenes_added']} added, "
            f"{d['scenes_changed']} changed, {d['scenes_removed']} removed, {d['assets_dirtied']} asset(s) marked dirty"
        ),
    )


@main.group()
def layers() -> None:
    """Which stages are enabled for a book."""


def _show_layers(layers: dict[str, bool]) -> None:
    click.echo(", ".join(f"{stage}={'on' if on else 'off'}" for stage, on in layers.items()))


@layers.command("set")
@click.argument("book_id")
@click.option("--enable", multiple=True, metavar="STAGE", help="Turn this stage on (repeat for more).")
@click.option(
    "--disable", multiple=True, metavar="STAGE", help="Turn this stage off: its pairs not yet running are released."
)
@click.option("--json", "as_json", is_flag=True)
def layers_set(book_id: str, enable: tuple[str, ...], disable: tuple[str, ...], as_json: bool) -> None:
    """Turn stages on or off for a book, and print every stage's layer. Queues nothing: a stage turned on gets work
    from the next regenerate."""
    from animastor_tasks.flow import layers as layers_flow

    result = layers_flow.set_layers(_wired().ports, book_id, list(enable), list(disable))
    emit(result, as_json, _show_layers)


@layers.command("show")
@click.argument("book_id")
@click.option("--json", "as_json", is_flag=True)
def layers_show(book_id: str, as_json: bool) -> None:
    """Print every stage's layer for a book (on or off). Changes nothing."""
    from animastor_tasks.flow import layers as layers_flow

    result = layers_flow.layers_of(_wired().ports, book_id)
    emit(result, as_json, _show_layers)


@main.command()
@click.argument("book_id")
@click.option("--json", "as_json", is_flag=True)
@click.option("--watch", is_flag=True, help="Refresh until every command ends, with rate and ETA (not with --json).")
@click.option("--interval", default=1.0, show_default=True, type=INTERVAL)
def status(book_id: str, as_json: bool, watch: bool, interval: float) -> None:
    """Commands of a book with progress, and every scene's state per stage (one cell each)."""
    from animastor_tasks.flow import status as status_flow
    from animastor_tasks.operator import render as views

    _watch_or_json(watch, as_json)
    rt = _wired()
    if as_json:
        emit(status_flow.status(rt.ports, book_id), True, lambda _: None)
        return

    def read() -> dict[str, Any]:  # with the database's time, which the commands' ages are measured against
        return {**status_flow.status(rt.ports, book_id), "read_at": rt.reads.clock()}

    with to_stdout():
        views.show_status(read, watch=watch, interval=interval)


@main.command("commands")
@click.argument("book_id", required=False)
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1, max=1_000_000))
@click.option("--json", "as_json", is_flag=True)
def commands_cmd(book_id: str | None, limit: int, as_json: bool) -> None:
    """Recent commands with status, reason, progress and age."""
    from animastor_tasks.flow import validate
    from animastor_tasks.flow.status import progress
    from animastor_tasks.operator import render as views

    rt = _wired()
    ports = rt.ports
    rows = ports.commands.commands(book=None if book_id is None else validate.known_book(ports, book_id), limit=limit)
    now = rt.reads.clock()  # the clock of `created_at`
    data = [
        {
            "command_id": r.command_id,
            "book_id": r.book_id,
            "stage": r.stage,
            "status": r.status,
            "reason": r.reason,
            "progress": progress(r),
            "age_seconds": max(0.0, round(now - r.created_at, 1)),
        }
        for r in rows
    ]
    emit(data, as_json, views.show_commands)


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C (not with --json).")
@click.option("--interval", default=2.0, show_default=True, type=INTERVAL)
def queues(as_json: bool, watch: bool, interval: float) -> None:
    """GPU queues: consumers, depth (? when the broker cannot say), running, lane limit, breaker, deferrals."""
    from animastor_tasks.operator import queue_view
    from animastor_tasks.operator import render as views

    _watch_or_json(watch, as_json)
    if watch:
        with to_stdout():
            views.watch_queues(lambda: queue_view.queue_overview(_wired()), interval=interval)
        return
    emit(queue_view.queue_overview(_wired()), as_json, views.show_queues)


def _watch_or_json(watch: bool, as_json: bool) -> None:
    """`--watch` redraws a view for people; JSON is one answer. *Why:* together, the JSON was printed once and
    the command exited 0, and a script that meant to follow a book took its first look for the last."""
    if watch and as_json:
        raise click.UsageError("--watch and --json do not go together: --json prints one answer, --watch a live view")


@main.command("reconcile")
@click.option("--json", "as_json", is_flag=True)
def reconcile_cmd(as_json: bool) -> None:
    """Run one reconcile pass over every book with work now (it never creates work)."""
    from animastor_tasks.flow import reconcile

    report = reconcile.reconcile(_wired().ports, force=True, whole=True)
    emit(report, as_json, lambda d: click.echo("\n".join(f"{k.replace('_', ' ')}: {v}" for k, v in d.items())))


for _command in (*control_commands.COMMANDS, *process_commands.COMMANDS):
    main.add_command(_command)


if __name__ == "__main__":
    main()
