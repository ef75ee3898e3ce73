"""The Celery app, its worker start-up checks and its per-process set-up.

Its settings come from the top-level `celeryconfig` module (part of the deployment's
shape), which builds them from the ANIMASTOR_* environment.
"""

from __future__ import annotations

import logging
import os
import sys
from functools import partial
from typing import Any

from celery import Celery, signals

from animastor_tasks.adapters.redis import counters
from animastor_tasks.config import Settings
from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.errors import ArtifactStoreError, ConfigError, redact_url
from animastor_tasks.worker import chain, flower_events, flower_settings, lost, tracing, warm
from animastor_tasks.worker.logs import LogSetup
from animastor_tasks.worker.presence import PresenceStep, StartingPresenceStep
from animastor_tasks.worker.timers import DropCancelledTimersStep

try:
    settings = Settings.from_env()
    log_setup = LogSetup.from_env()  # ANIMASTOR_LOG_LEVEL / ANIMASTOR_LOG_FORMAT, checked at start-up too
    tracing.wanted()  # ANIMASTOR_OTEL too
except ConfigError as err:  # a worker or beat with a bad setting stops here, with the variable named
    sys.stderr.write(f"animastor-tasks: {err}\n")
    raise SystemExit(2) from err

app = Celery("animastor_tasks", include=["animastor_tasks.worker.tasks"])
app.config_from_object("celeryconfig", force=True)
flower_settings.guard_flower_command()  # `celery -A animastor_tasks flower`, from any directory: auth or exit 2
app.steps["worker"].add(StartingPresenceStep)  # beats before the consumer can (worker/presence.py)
app.steps["consumer"].add(PresenceStep)
app.steps["worker"].add(DropCancelledTimersStep)  # each job's ended time-limit timer, let go (worker/timers.py)

log = logging.getLogger("animastor.worker")
# INFO unless `-l` or ANIMASTOR_LOG_LEVEL says otherwise; JSON lines with ANIMASTOR_LOG_FORMAT=json; job context.
log_setup.connect()

# Optional OpenTelemetry (the otel extra, ANIMASTOR_OTEL=1): set up where tasks run, flushed on the way out.
signals.worker_process_init.connect(tracing.on_process_init)
signals.worker_process_shutdown.connect(tracing.on_shutdown)
signals.worker_shutdown.connect(tracing.on_shutdown)
# Counters a process holds (adapters/redis/counters.py) go out before it leaves.
signals.worker_process_shutdown.connect(counters.flush_all)
signals.worker_shutdown.connect(counters.flush_all)
# Jobs a process runs for its own freed slot (worker/chain.py): announced when the worker announces tasks, none
# started once it shuts down (`shutting_down`).
signals.worker_init.connect(flower_events.remember_task_events)


@signals.worker_init.connect
def set_up_solo(sender: Any = None, **_: Any) -> None:
    """With the solo or thread pool the worker runs the tasks itself: it traces them and warms its
    connections (a prefork worker's children do, in `fresh_connections`)."""
    pool = getattr(sender, "pool_cls", None)
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    if not any(word in str(name) for word in ("prefork", "processes")):
        tracing.setup()
        warm.warm_up(app)


@signals.celeryd_after_setup.connect
def let_go_of_previous_run(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Jobs this node's previous run held when it was killed are let go before this run takes any (lost.py): once
    its logging is set up, before its pool starts. *Why not at `worker_init`:* before Celery's logging, the lines
    saying which jobs were let go came out bare, with no time and no level."""
    if isinstance(sender, str) and sender:
        lost.let_go_of_previous_run(settings, sender, app, events=bool(getattr(instance, "task_events", False)))


@signals.worker_ready.connect
def hook_shutdown(sender: Any = None, **_: Any) -> None:
    """Each shutdown signal, warm or cold, runs `shutting_down` before Celery's own handler (lost.py says why)."""
    node = getattr(sender, "hostname", None)
    if isinstance(node, str) and node:
        lost.first_on_shutdown_signals(partial(shutting_down, node))


def shutting_down(node: str) -> None:
    """No process of this worker starts a job of its own any more (chain.py), and a job it runs that a rollout or a
    cold shutdown then kills is not counted as worker-lost at its next start (lost.py)."""
    chain.stop_keeping()
    lost.note_shutdown(settings, node)


lost.first_on_remote_shutdown(shutting_down)  # Flower's Shut Down, `celery control shutdown`: no signal to wrap


@signals.celeryd_init.connect
def refuse_unknown_queues(sender: str, instance: Any, conf: Any, options: dict[str, Any], **_: Any) -> None:
    """A worker consumes only queues the media registry (or the control plane) knows, and gets the start checks of
    each it will consume: without `-Q` that is every queue of `task_queues` but `-X`'s (a bare `celery worker`
    took GPU jobs unchecked, and failed each `misconfigured` when its generator was not installed).

    Runs before Celery selects the queues, so the operator gets our message and exit code 2.
    """
    known = {CONTROL_QUEUE, *settings.registry.queues()}
    named = _queue_names(options.get("queues"))
    unknown = sorted(named - known)
    if unknown:
        sys.stderr.write(
            f"animastor-tasks: refusing to consume unknown queue(s) {', '.join(unknown)}; "
            f"known queues: {', '.join(sorted(known))} (stages come from ANIMASTOR_STAGES)\n"
        )
        raise SystemExit(2)
    consumed = (named or known) - _queue_names(options.get("exclude_queues"))
    refuse_control_beside_gpu(consumed, bare=not named)
    refuse_generators_not_built(consumed)
    refuse_a_database_not_migrated()
    warn_of_an_evicting_redis([settings.redis_url, *([] if settings.broker_is_amqp else [settings.broker_url])])
    if consumed & set(settings.registry.queues()):
        refuse_an_artifact_store_that_refuses()


def _queue_names(raw: Any) -> set[str]:
    """The queues of a `-Q`/`-X` option: Celery passes a list, a comma-separated string, or nothing."""
    items = [raw] if isinstance(raw, str) else raw or []
    return {q.strip() for item in items for q in str(item).split(",") if q.strip()}


def refuse_control_beside_gpu(queues: set[str], *, bare: bool) -> None:
    """The control queue and a GPU queue are never consumed by one worker. *Why:* its slots are shared, so a long
    GPU job held up the control work behind it (gate passes, regenerate, Stop All), and control work took a slot
    a GPU job was dispatched for. `bare`: no `-Q` was given, which is how a worker came to consume both."""
    gpu = sorted(queues & set(settings.registry.queues()))
    if CONTROL_QUEUE in queues and gpu:
        how = " (without -Q a worker consumes every queue: name its queues with -Q)" if bare else ""
        sys.stderr.write(
            f"animastor-tasks: refusing to consume the control queue {CONTROL_QUEUE} and GPU queue(s) "
            f"{', '.join(gpu)} in one worker{how}; run them as separate workers: `animastor-tasks worker` for "
            "the control queue, `animastor-tasks worker --stage <stage>` for each GPU queue\n"
        )
        raise SystemExit(2)


def refuse_generators_not_built(queues: set[str]) -> None:
    """A GPU worker builds the generator of each stage it consumes before it starts (a factory is cheap: it is
    called per job). *Why:* one not installed on this host (`"generator": "htp"`) let the worker start healthy
    and fail every job `misconfigured`, said only at DEBUG by the warm-up. The control worker builds none: a
    generator need be installed only where its stage runs."""
    from animastor_tasks.generators import load_generator

    problems = []
    for spec in settings.registry.stages:
        if spec.queue in queues:
            try:
                load_generator(spec, settings)
            except Exception as err:  # the same for every job of the stage: the worker's setup, not a job's
                problems.append(str(err))
    if problems:
        sys.stderr.write(f"animastor-tasks: refusing to start: {'; '.join(problems)}\n")
        raise SystemExit(2)


EVICTION_PROBE_SECONDS = 2.0  # a warning's check: a Redis that does not answer in time delays a start no longer
STORE_PROBE_SECONDS = 10.0  # a store's refusal comes in well under it; past it, the store is taken as down for now


def refuse_a_database_not_migrated() -> None:
    """A worker of a release whose migrations the database lacks stops with exit 3 (the store not ready), saying what
    to run. *Why:* a GPU host upgraded before `db migrate` failed each job at its start, gave it back and was handed
    it again, a pair dispatched 33 times a minute and its slot doing no work. A database that does not answer now
    is left to the jobs: they wait for it as for any outage."""
    from animastor_tasks.adapters.postgres.migrations import missing_migrations
    from animastor_tasks.adapters.postgres.pool import NOT_MIGRATED

    missing = missing_migrations(settings.database_url, within=STORE_PROBE_SECONDS)
    if missing:
        sys.stderr.write(f"animastor-tasks: refusing to start: {NOT_MIGRATED} (it lacks {', '.join(missing)})\n")
        raise SystemExit(3)


def warn_of_an_evicting_redis(urls: list[str]) -> None:
    """A Redis that may evict keys (any `maxmemory-policy` but `noeviction`) is named at start. *Why:* an evicted lease
    took a running job's pair over (its GPU work done again), an evicted message or record lost a job or a slot's
    hand-over, and the logs blamed a Redis loss; nothing pointed at the policy (Redis memory hunt)."""
    from animastor_tasks.adapters.redis.connection import eviction_policy

    for url in dict.fromkeys(urls):
        policy = eviction_policy(url, within=EVICTION_PROBE_SECONDS)
        if policy not in (None, "noeviction"):
            sys.stderr.write(
                f"animastor-tasks: the Redis at {redact_url(url)} may evict keys (maxmemory-policy {policy}): an "
                "evicted lease or message costs GPU work done again or a job lost; set maxmemory-policy noeviction "
                "(docs/deployment.md, 'Redis memory')\n"
            )


def refuse_an_artifact_store_that_refuses() -> None:
    """A GPU worker stores one small artifact before it starts. A store that refuses it (wrong keys, a bucket
    gone, a directory it cannot write) stops it with exit 2; one that does not answer now may come back, and its
    jobs wait for it: the worker starts, saying so."""
    from animastor_tasks.adapters.artifacts import probe_artifact_store

    try:
        probe_artifact_store(settings, within=STORE_PROBE_SECONDS)
    except ArtifactStoreError as err:
        if err.unreachable:
            sys.stderr.write(f"animastor-tasks: {err}: not reachable now; starting all the same\n")
            return
        sys.stderr.write(f"animastor-tasks: refusing to start: {err}\n")
        raise SystemExit(2) from err


@signals.celeryd_after_setup.connect
def announce(sender: str, instance: Any, **_: Any) -> None:
    queues = sorted(instance.app.amqp.queues.consume_from or {})
    log.info("[WORKER] %s consuming %s (broker %s)", sender, ",".join(queues), redact_url(settings.broker_url))


def gpu_for_child(gpu_ids: str, index: int) -> str | None:
    """The one GPU a pool child sees when the worker was given `--gpus` (None: leave it alone)."""
    ids = [g.strip() for g in gpu_ids.split(",") if g.strip()]
    return ids[index % len(ids)] if ids else None


@signals.worker_process_init.connect
def fresh_connections(**_: Any) -> None:
    """A forked child builds its own pools on first use; nothing crosses the fork.

    With `--gpus 0,1` each pool child sees exactly one GPU (its index picks it).
    """
    from billiard.process import current_process

    from animastor_tasks.worker import wiring

    wiring.reset()
    gpu = gpu_for_child(os.environ.get("ANIMASTOR_GPU_IDS", ""), getattr(current_process(), "index", 0) or 0)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    # Nothing here waits on a store: the child tells its parent it is up only once this returns, and one that
    # takes longer than `worker_proc_alive_timeout` (4 s) is killed and forked again (a Redis cut off, read here,
    # did that for as long as the partition lasted). The warm-up reads and connects in the background.
    warm.warm_up(app)
