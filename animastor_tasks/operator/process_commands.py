"""The commands that start or stop processes: stores (`up`, `down`), workers, beat, Flower, the metrics
exporter, the reference inference server and the demo.

Celery processes are started as `<this interpreter> -m celery`, so an installed animastor-tasks works
from any directory and without its virtual environment on PATH.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import click

from animastor_tasks.config import Settings
from animastor_tasks.errors import ConfigError
from animastor_tasks.operator.options import Seconds

#: Log levels a Celery process takes (`--loglevel`, ANIMASTOR_LOG_LEVEL).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_loglevel_option = click.option(
    "--loglevel",
    "-l",
    default=None,
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    help="Log level (default: ANIMASTOR_LOG_LEVEL, else INFO).",
)


def _log_level(given: str | None) -> str:
    """`--loglevel` when given, else ANIMASTOR_LOG_LEVEL, else INFO (a bad variable is a ConfigError)."""
    from animastor_tasks.worker.logs import level_from_env

    return given.upper() if given else level_from_env(os.environ)


def _exec_celery(*args: str) -> None:
    """Replace this process with `celery -A animastor_tasks <args>` run by this interpreter."""
    argv = [sys.executable, "-m", "celery", "-A", "animastor_tasks", *args]
    os.execv(argv[0], argv)


#: `click.Context.meta` key: the store variables `main` filled in from local stores `up` left running.
LOCAL_ENV_FILLED = "animastor.local_env_filled"


@click.command()
def up() -> None:
    """Bring the stores up and migrate: the ones the environment names (exit 3 when one does not answer), and for
    each store it does not name the default one when it answers, else a local embedded one."""
    from animastor_tasks.adapters.postgres.migrations import migrate
    from animastor_tasks.adapters.postgres.pool import Database
    from animastor_tasks.dev import stores as devstack
    from animastor_tasks.dev.local_stores import BROKER_VAR, DATABASE_VAR, REDIS_VAR

    # Named by the operator, not filled in by `main` from local stores running (those `up` may restart).
    filled = click.get_current_context().meta.get(LOCAL_ENV_FILLED, ())
    named = [v for v in (DATABASE_VAR, REDIS_VAR, BROKER_VAR) if os.environ.get(v, "").strip() and v not in filled]
    overrides, _ = devstack.ensure_stores(log=click.echo, named=named)
    os.environ.update(overrides)
    stores = devstack.LocalStores()
    if overrides:
        stores.data_dir.mkdir(parents=True, exist_ok=True)
        stores.env_path.write_text(devstack.render_env(overrides))
        click.echo(f"local stores: settings in {stores.env_path} (animastor-tasks commands load them by themselves)")
    settings = Settings.from_env()
    db = Database(settings.database_url)
    try:
        applied = migrate(db)
    finally:
        db.close()
    click.echo(f"postgres: migrations applied: {', '.join(applied)}" if applied else "postgres: schema up to date")
    gpu = " and ".join(f"`animastor-tasks worker --stage {name}`" for name in settings.registry.names())
    click.echo(
        f"ready: start `animastor-tasks worker` (control), {gpu} (a GPU worker per stage) and `animastor-tasks beat`"
    )


@click.command()
def down() -> None:
    """Stop the local stores `up` started (if any) and delete what they stored."""
    from animastor_tasks.dev import stores as devstack

    if devstack.main(["down"]) != 0:  # it said why on stderr
        sys.exit(3)


_GPU_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9:/_-]*")  # an index, or a GPU-/MIG- UUID as CUDA_VISIBLE_DEVICES takes


def _gpu_ids(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[str]:
    """One pool process per GPU: an empty entry would add a process without a GPU of its own (the children
    are given the ids in turn, so two of them would share one), and a repeated id puts two on one GPU."""
    if value is None:
        return []
    ids = [g.strip() for g in value.split(",")]
    bad = [g for g in ids if not _GPU_ID.fullmatch(g)]
    if bad:
        raise click.BadParameter(f"GPU ids are comma-separated indexes or UUIDs, got {bad[0]!r} in {value!r}")
    if len(set(ids)) < len(ids):
        raise click.BadParameter(f"a GPU id is named twice in {value!r}: each pool process needs a GPU of its own")
    return ids


def _one_stage(_ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]) -> str | None:
    """The one stage named, if any. *Why:* click kept the last of `--stage audio --stage image` and started an
    image-only worker without a word."""
    if len(value) > 1:
        each = " and ".join(f"`animastor-tasks worker --stage {shlex.quote(stage)}`" for stage in dict.fromkeys(value))
        raise click.BadParameter(
            f"given {len(value)} times ({', '.join(value)}): a GPU worker serves one stage; run one worker per"
            f" stage: {each}"
        )
    return value[0] if value else None


@click.command(context_settings={"ignore_unknown_options": True})
@click.option(
    "--stage",
    multiple=True,
    callback=_one_stage,
    metavar="STAGE",
    help="Run a GPU worker for this stage, one stage per worker (default: the control worker).",
)
@click.option(
    "--gpus", default=None, callback=_gpu_ids, help="Comma-separated GPU ids, each once; one pool process per GPU."
)
@click.option("--hostname", "-n", default=None)
@_loglevel_option
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def worker(
    stage: str | None, gpus: list[str], hostname: str | None, loglevel: str | None, celery_args: tuple[str, ...]
) -> None:
    """Start a Celery worker: the control worker, or a GPU worker for one stage.

    Other options go to `celery worker` as they are. Stop it with SIGTERM: the running job finishes first.
    """
    from animastor_tasks.domain.registry import CONTROL_QUEUE

    settings = Settings.from_env()
    level = _log_level(loglevel)
    _refuse_overrides(celery_args, gpus=bool(gpus))
    if stage is None:
        if gpus:  # a GPU host's worker with its stage forgotten: never a control worker there
            raise click.UsageError("--gpus is for a GPU worker: name its --stage")
        queue, concurrency, name = CONTROL_QUEUE, "2", hostname or "control@%h"
    else:
        if stage not in settings.registry:
            raise ConfigError(
                f"--stage {stage!r} is not a registered stage (known: {', '.join(settings.registry.names())})"
            )
        queue, name = settings.registry.get(stage).queue, hostname or f"{stage}@%h"
        concurrency = str(len(gpus) or 1)
        if gpus:
            os.environ["ANIMASTOR_GPU_IDS"] = ",".join(gpus)
    _exec_celery(
        "worker",
        "-Q",
        queue,
        "-c",
        concurrency,
        "--prefetch-multiplier",
        "1",
        "-n",
        name,
        "-E",
        "-l",
        level,
        # Gossip is unused here (presence has its own heartbeats), and its consumer step can crash the
        # worker while the broker restarts (kombu#582: `_close` on a connection that is already None).
        "--without-gossip",
        *celery_args,
    )


def _refuse_overrides(celery_args: tuple[str, ...], *, gpus: bool) -> None:
    """Celery options that would undo what this command sets, passed on last, are refused. *Why:* `--stage audio -Q
    animastor.control` started a control worker named audio, `-X gpu.audio` one consuming nothing, and `--gpus 0,1 -c
    4` (or `--autoscale`) several processes on each GPU."""
    per_gpu = {"-c": "--concurrency", "": "--autoscale"} if gpus else {}
    for arg in celery_args:
        for short, long in {"-Q": "--queues", "-X": "--exclude-queues", **per_gpu}.items():
            if arg == long or arg.startswith(f"{long}=") or (short and arg.startswith(short) and arg[1] != "-"):
                why = "the queue of --stage, or the control one" if short in ("-Q", "-X") else "a process per GPU"
                raise click.UsageError(f"{arg}: the worker command sets {long} itself ({why})")


@click.command(context_settings={"ignore_unknown_options": True})
@_loglevel_option
@click.option("--schedule", "-s", default=None, help="Accepted for compatibility, unused: beat keeps no schedule file.")
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def beat(loglevel: str | None, schedule: str | None, celery_args: tuple[str, ...]) -> None:
    """Start beat: the tick every ANIMASTOR_TICK_SECONDS, reconcile every ANIMASTOR_RECONCILE_SECONDS.

    Other options go to `celery beat` as they are. A second beat is harmless (dispatch is compare-and-set).
    Its scheduler (`worker/beat_schedule.py`) writes no file, so it runs from any directory, read-only ones too.
    """
    from animastor_tasks.worker.logs import format_from_env

    level = _log_level(loglevel)
    quiet = ["--quiet"] if format_from_env(os.environ) == "json" else []  # no banner among the JSON lines
    _exec_celery(*quiet, "beat", "-l", level, *(["-s", schedule] if schedule else []), *celery_args)


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
def flower(flower_args: tuple[str, ...]) -> None:
    """Start Flower on the task events, with basic auth from ANIMASTOR_FLOWER_BASIC_AUTH (required).

    Address and port: ANIMASTOR_FLOWER_ADDRESS (127.0.0.1) and ANIMASTOR_FLOWER_PORT (5555). Refuses to
    start (exit status 2) without credentials; ANIMASTOR_FLOWER_DEV_NO_AUTH=1 allows none on loopback only, for the
    web pages (Flower's HTTP API under /api/ still answers 401 unless FLOWER_UNAUTHENTICATED_API is set).
    Other options go to `celery flower` as they are (`--url_prefix=flower`), except those that decide who reaches
    it (`--address`, `--port`, `--basic_auth`, `--auth`, `--unix_socket`, and `--conf`, however many dashes
    lead them): refused, they come from the environment.
    """
    from animastor_tasks.worker import flower_settings

    try:
        flower_settings.flower_options(os.environ)
        # And a `--conf` of its own: Flower keeps the last one, and these settings would never run.
        flower_settings.refuse_guarded_flags(flower_args, flower_settings.GUARDED_HERE)
    except flower_settings.Refused as err:  # said here, before Celery starts: exit status 2
        raise ConfigError(f"refusing to start Flower: {err}") from None
    _exec_celery("flower", f"--conf={flower_settings.conf_path()}", *flower_args)


@click.command("dev-inference-server")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535))
@click.option("--latency", default=0.0, show_default=True, type=Seconds(0, 3_600), help="Seconds added to requests.")
@click.option("--failure-rate", default=0.0, show_default=True, help="Share of requests answered 503.")
@click.option("--api-key", default=None, envvar="ANIMASTOR_INFERENCE_API_KEY")
@click.option("--fail-first", default=0, show_default=True, help="Answer the first N generate requests 503.")
@click.option(
    "--retry-after", default=None, type=Seconds(0, 86_400), help="Seconds sent as Retry-After with an injected 503."
)
def dev_inference_server(
    host: str,
    port: int,
    latency: float,
    failure_rate: float,
    api_key: str | None,
    fail_first: int,
    retry_after: float | None,
) -> None:
    """Run the reference inference server (our protocol and the OpenAI routes; real WAV and PNG)."""
    from animastor_tasks.dev.inference_server import make_server, serve

    try:
        server = make_server(
            host,
            port,
            latency=latency,
            failure_rate=failure_rate,
            api_key=api_key,
            fail_first=fail_first,
            retry_after=retry_after,
        )
    except ValueError as err:  # a bad knob: the operator gets our message and exit code 2
        raise ConfigError(f"dev-inference-server: {err}") from err
    except OSError as err:  # the port taken, the address not this host's
        raise ConfigError(f"dev-inference-server: cannot listen on {host}:{port}: {err.strerror or err}") from err
    serve(server)


@click.command("metrics")
# `show_envvar`: an error then names the variable, which an operator who set only it recognizes.
@click.option("--address", default="127.0.0.1", show_default=True, envvar="ANIMASTOR_METRICS_ADDRESS", show_envvar=True)
@click.option(
    "--port",
    default=9808,
    show_default=True,
    envvar="ANIMASTOR_METRICS_PORT",
    show_envvar=True,
    type=click.IntRange(0, 65535),
)
def metrics_cmd(address: str, port: int) -> None:
    """Serve Prometheus metrics on http://ADDRESS:PORT/metrics until Ctrl-C (see docs/operations.md)."""
    from animastor_tasks.operator import metrics

    try:
        metrics.serve(address, port)
    except OSError as err:
        raise ConfigError(f"cannot listen on {address}:{port}: {err.strerror or err}") from err


@click.command()
@click.option("--keep-running", is_flag=True, help="Leave the stack up after the story, until Ctrl-C.")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Logs and generated Flower credentials (default: .animastor-local/demo).",
)
def demo(keep_running: bool, run_dir: Path | None) -> None:
    """Start the whole stack, run a scripted story on the sample book, stop everything again."""
    from animastor_tasks.dev import demo as demo_module

    sys.exit(demo_module.main(keep_running=keep_running, run_dir=run_dir))


COMMANDS = (up, down, worker, beat, flower, dev_inference_server, metrics_cmd, demo)
