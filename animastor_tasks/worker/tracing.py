"""Optional OpenTelemetry tracing of the Celery tasks: one trace per command, regenerate to GPU jobs.

Why optional: most deployments have no collector, and the OpenTelemetry packages are an extra
(`pip install 'animastor-tasks[otel]'`). Tracing is on only when that extra is installed and
`ANIMASTOR_OTEL=1`; otherwise nothing here imports OpenTelemetry and every hook is a no-op.

The Celery instrumentation puts the trace context into each message's headers when a task is
published and continues it when the task runs, so a regenerate's run span is the parent of the
jobs its gate pass publishes, a finished job is the parent of the gate task it sends, and so on.
The exporter follows the standard environment: `OTEL_TRACES_EXPORTER` (`otlp`, the default: gRPC
when its package is installed, else the extra's OTLP/HTTP one; `console`; `none`),
`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER`...

Set up once per process that runs tasks: in each prefork child (a batch exporter's thread does
not survive a fork), or in the worker itself for the solo and thread pools.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import metadata
from typing import Any

from animastor_tasks.errors import ConfigError

log = logging.getLogger("animastor.worker")
SWITCH = "ANIMASTOR_OTEL"

_provider: Any = None


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """True when the operator asked for tracing (`ANIMASTOR_OTEL=1`); unset, empty or `0` is off. Anything else
    is a `ConfigError` naming the variable: `true` turned tracing off without a word."""
    raw = (os.environ if env is None else env).get(SWITCH, "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{SWITCH}={raw!r} must be 1 (trace) or 0 (off)")
    return raw == "1"


def _exporter(env: Mapping[str, str]) -> Any:
    """The span exporter `OTEL_TRACES_EXPORTER` names, found by the SDK's own entry points; None: no export."""
    name = env.get("OTEL_TRACES_EXPORTER", "").split(",")[0].strip() or "otlp"
    if name == "none":
        return None
    # `otlp` is the gRPC exporter's name; the otel extra ships the HTTP one, which takes it over when alone.
    names = [name, "otlp_proto_http"] if name == "otlp" else [name]
    available = {ep.name: ep for ep in metadata.entry_points(group="opentelemetry_traces_exporter")}
    found = [available[n] for n in names if n in available]
    if not found:
        log.warning("[WORKER] tracing: no span exporter %r installed (OTEL_TRACES_EXPORTER); spans are dropped", name)
        return None
    return found[0].load()()


def setup(env: Mapping[str, str] | None = None, exporter: Any = None) -> Any:
    """Instrument Celery in this process; returns the `TracerProvider`, or None when tracing is off.

    `exporter` (tests) is used as given, span by span and without touching the global provider;
    otherwise the exporter comes from the environment, batched, and the provider becomes global.
    Calling it again returns the same provider.
    """
    global _provider
    env = os.environ if env is None else env
    if _provider is not None or not wanted(env):
        return _provider
    try:
        from opentelemetry import trace
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as err:
        log.warning("[WORKER] ANIMASTOR_OTEL=1 but the otel extra is missing (%s): tracing off", err)
        return None
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "animastor-tasks"}))
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        chosen = _exporter(env)
        if chosen is not None:
            provider.add_span_processor(BatchSpanProcessor(chosen))
        trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument(tracer_provider=provider)
    _provider = provider
    log.info("[WORKER] tracing on (OpenTelemetry, Celery instrumented)")
    return provider


def shutdown() -> None:
    """Flush and stop this process's tracing (a prefork child leaves by `os._exit`: no atexit flush)."""
    global _provider
    if _provider is None:
        return
    provider, _provider = _provider, None
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    CeleryInstrumentor().uninstrument()
    provider.shutdown()


def current_context() -> Any:
    """The trace context here and now (None when tracing is off), to continue it later with `span`."""
    if _provider is None:
        return None
    from opentelemetry import context

    return context.get_current()


@contextmanager
def span(name: str, parent: Any, **attributes: str) -> Iterator[None]:
    """A span around work that is not a Celery task run of its own (a job run in its predecessor's task,
    `worker/chain.py`), a child of `parent` (`current_context()` where the work was decided); nothing
    when tracing is off."""
    if _provider is None:
        yield
        return
    tracer = _provider.get_tracer("animastor_tasks")
    with tracer.start_as_current_span(name, context=parent, attributes=attributes):
        yield


def on_process_init(**_: Any) -> None:
    """`worker_process_init`: a prefork child runs the tasks, so it traces them."""
    setup()


def on_shutdown(**_: Any) -> None:
    """`worker_process_shutdown` / `worker_shutdown`: flush the spans still buffered."""
    try:
        shutdown()
    except Exception as err:  # a collector gone at shutdown must not fail the worker's exit
        log.warning("[WORKER] tracing shutdown: %s", err)
