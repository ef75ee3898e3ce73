"""Prometheus metrics for operators: `animastor-tasks metrics --port 9808` (binds 127.0.0.1 by default).

Why a collector and not counters in this process: the numbers live where the work happens.
Every worker adds to one Redis hash (`adapters/redis/counters.py`), queues and presence are in Redis and
the broker, commands in Postgres; each scrape reads them fresh (a few round trips), so the
exporter holds no state, can restart at will and any number of them agree. The one exception: the idle
pairs' counts (`IdlePairs`), a scan of every pair, made now and then and served in between.

A store that cannot be read drops only its own families for that scrape and sets
`animastor_store_up{store=...}` to 0: a scrape never fails as a whole.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from animastor_tasks.adapters.redis.connection import RedisConnection
from animastor_tasks.adapters.redis.counters import buckets_for, histogram_field
from animastor_tasks.config import Settings
from animastor_tasks.domain.keys import Keyspace
from animastor_tasks.domain.vocabulary import IN_FLIGHT, AssetState, JobOutcome, Outcome
from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.worker.wiring import Wiring

log = logging.getLogger("animastor.metrics")

# A refused job is counted as the dispatch outcome `fence_rejected`, not as a job event.
JOB_EVENTS = (
    "started",
    "retry",
    "worker_lost",
    "process_lost",  # its pool process died mid-job, and the worker's main process let the job go (worker/lost.py)
    "node_lost",  # its worker node stopped beating (a lost host, a replaced pod): the tick let the job go
    "kept",  # run by the process whose slot it was claimed for, without a broker message (worker/chain.py)
    "store_paused",  # its start check found Postgres unreachable from its host: its process paused until it answered
    "host_paused",  # its host's runs failed in a row (others' succeeding, or opening the breaker): its process paused
    *(str(o) for o in JobOutcome if o is not JobOutcome.FENCE_REJECTED),
)
#: Histograms the flows record with `Counters.observe`: name -> help text.
HISTOGRAMS = {
    "gate_pass_seconds": "Duration of gate passes that released or dispatched work (animastor.gate).",
    "tick_seconds": "Duration of the beat tick (sending gate_batch tasks for the books that are due).",
    "reconcile_seconds": "Duration of the beat's reconcile passes (each repairs the next books with work).",
}
#: Histograms recorded per stage as `<name>:<stage>`, exported with a `stage` label: name -> help text.
STAGE_HISTOGRAMS = {
    "job_seconds": "Duration of GPU jobs from their start to their verdict (ready, failed, stopped, given back).",
    "queue_wait_seconds": "Time GPU jobs waited in their queue: dispatch to job start.",
}
DEFAULT_PORT = 9808
# A scrape answers within Prometheus' default scrape timeout (10 s) with Postgres down: it waits for a
# connection this long, once (a scrape whose first Postgres read failed makes no second one).
SCRAPE_DB_WAIT_SECONDS = 2.0
DEFAULT_ADDRESS = "127.0.0.1"
# The idle pairs are counted again once this many times the last count's duration has passed since it ended: at
# most half a percent of the exporter's time (a count of 1 ms, on each scrape; of 250 ms, every 50 s).
IDLE_COUNT_SPACING = 200


class IdlePairs:
    """The dirty, ready and failed pairs per stage: a scan of every pair, made on a scrape only once
    `IDLE_COUNT_SPACING` times its last duration has passed, and served as counted in between. A count that
    failed (past its bound) is no count: its series are left out until the next one answers."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._due = float("-inf")
        self._counts: dict[tuple[str, str], int] | None = None

    def read(self, rt: Wiring) -> dict[tuple[str, str], int] | None:
        started = self._clock()
        if started >= self._due:
            try:
                counts = rt.reads.pairs_by_state()
            except Exception as err:  # the in-flight read just answered: Postgres is up, this count is too slow
                log.warning("[METRICS] idle pairs not counted (their series are left out): %s", err)
                self._counts = None
            else:
                self._counts = {k: n for k, n in counts.items() if k[1] not in IN_FLIGHT}
            ended = self._clock()
            self._due = ended + IDLE_COUNT_SPACING * (ended - started)
        return self._counts


class AnimastorCollector(Collector):
    """Reads counters, queues, presence and commands on every scrape; the idle pairs now and then."""

    def __init__(self, wiring: Callable[[], Wiring], *, clock: Callable[[], float] = time.monotonic) -> None:
        self._wiring = wiring
        self._idle = IdlePairs(clock)

    def collect(self) -> Iterator[Metric]:
        rt = self._wiring()
        up = {"redis": 1.0, "postgres": 1.0}  # "broker" is added when the queue depths were asked
        try:
            fields = {_text(k): _text(v) for k, v in rt.counters.read().items()}
            now = rt.ports.clock()  # the Redis server's clock, which wrote the observations' times
        except Exception as err:  # the exporter reports a store outage instead of failing the scrape
            log.warning("[METRICS] counters unreadable: %s", err)
            fields, up["redis"], now = {}, 0.0, 0.0
        if up["redis"]:
            stages = rt.settings.registry.names()
            yield from _counter_families(fields, stages)
            yield from _histogram_families(fields, stages, now)
            try:
                yield from _queue_families(rt, up)
            except Exception as err:
                log.warning("[METRICS] queues unreadable: %s", err)
                up["redis"] = 0.0
        if up["postgres"]:  # not when the queue view found it down: a scrape waits for Postgres once
            yield from _postgres_families(rt, up, self._idle)
        store_up = GaugeMetricFamily("animastor_store_up", "1 when the store answered this scrape.", labels=["store"])
        for store, value in up.items():
            store_up.add_metric([store], value)
        yield store_up


def _postgres_families(rt: Wiring, up: dict[str, float], idle: IdlePairs) -> Iterator[Metric]:
    try:
        pairs = {(stage, str(state)): 0 for stage in rt.settings.registry.names() for state in IN_FLIGHT}
        pairs.update(rt.reads.pairs_in_flight())  # one read serves both pair families
        families = [_commands_family(rt), _pending_family(pairs)]
    except Exception as err:
        log.warning("[METRICS] commands unreadable: %s", err)
        up["postgres"] = 0.0
    else:
        counted = idle.read(rt)
        if counted is not None:
            stages, idle_states = rt.settings.registry.names(), [s for s in AssetState if s not in IN_FLIGHT]
            pairs.update({(stage, str(state)): 0 for stage in stages for state in idle_states} | counted)
        yield from [*families, _pairs_family(pairs)]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0


def _counter_families(fields: dict[str, str], stages: Iterable[str]) -> Iterator[Metric]:
    dispatch = CounterMetricFamily(
        "animastor_dispatch_outcomes", "Dispatch attempts by outcome (see the outcome taxonomy).", labels=["outcome"]
    )
    fence = CounterMetricFamily(
        "animastor_fence_rejections",
        "GPU jobs refused at start or commit: a stale fencing token (superseded, taken over), or the pair's authority"
        " gone by its start (Stop All, its layer off, no active command). The same count as"
        " animastor_dispatch_outcomes_total{outcome='fence_rejected'}.",
    )
    blocked = CounterMetricFamily(
        "animastor_blocked_commands", "Commands BLOCKED because no worker consumed their stage.", labels=["stage"]
    )
    jobs = CounterMetricFamily("animastor_jobs", "GPU job events by kind and stage.", labels=["event", "stage"])
    revoke = CounterMetricFamily("animastor_revoke_failures", "Revoke broadcasts that failed (cancel still holds).")
    lost = CounterMetricFamily(
        "animastor_lost_refills",
        "Books handed a free slot whose refill never reported back (a control worker killed running it, a message"
        " the broker refused), put back on the lane's waiting list by the tick.",
        labels=["stage"],
    )
    late = CounterMetricFamily(
        "animastor_late_refills",
        "Books handed a free slot whose refill was not back after two ticks while control messages waited (a burst of"
        " commands): put back on the lane's waiting list by the tick; nothing died.",
        labels=["stage"],
    )
    lost_passes = CounterMetricFamily(
        "animastor_lost_gate_passes",
        "Books whose gate pass was lost with its holder (a control worker killed running a batch or a regenerate),"
        " sent again by the tick once the hold lapsed.",
    )
    given_up = CounterMetricFamily(
        "animastor_lost_gate_passes_given_up",
        "Lost gate passes not sent again: their book's passes were lost with their process three times in a row (does"
        " its pass kill it?); sent again, alone, only when something else makes the book due.",
    )
    # Known label values start at 0 so that rate() and alerts work from the first scrape.
    seen: dict[str, float] = {f"dispatch:{o}": 0.0 for o in Outcome if o != Outcome.DEFERRED}
    seen.update({f"{kind}:{stage}": 0.0 for kind in ("blocked", "lost_refill", "late_refill") for stage in stages})
    seen.update({f"job:{e}:{stage}": 0.0 for e in JOB_EVENTS for stage in stages})
    seen["revoke:failed"] = seen["lost_pass"] = seen["lost_pass_given_up"] = 0.0
    seen.update({k: _number(v) for k, v in fields.items()})
    fence_total = 0.0
    for name, n in sorted(seen.items()):
        kind, _, label = name.partition(":")
        if kind == "dispatch":
            dispatch.add_metric([label], n)
            if label == "fence_rejected":
                fence_total += n
        elif kind == "blocked":
            blocked.add_metric([label], n)
        elif kind == "lost_refill":
            lost.add_metric([label], n)
        elif kind == "late_refill":
            late.add_metric([label], n)
        elif kind == "job":  # `job:<event>:<stage>`; a field without a stage predates the label: stage ""
            event, _, stage = label.partition(":")
            jobs.add_metric([event, stage], n)
        elif name == "revoke:failed":
            revoke.add_metric([], n)
        elif name == "lost_pass":
            lost_passes.add_metric([], n)
        elif name == "lost_pass_given_up":
            given_up.add_metric([], n)
    fence.add_metric([], fence_total)
    yield from (dispatch, fence, blocked, jobs, lost, late, lost_passes, given_up, revoke)


def _histogram_families(fields: dict[str, str], stages: Iterable[str], now: float) -> Iterator[Metric]:
    last = GaugeMetricFamily(
        "animastor_last_observation_timestamp_seconds",
        "Unix time of the latest observation of each timed flow (a stale tick: beat or the control worker is down).",
        labels=["name"],
    )
    age = GaugeMetricFamily(
        "animastor_last_observation_age_seconds",
        "Seconds since the latest observation of each timed flow, by the clock that stamped it (Redis's): what the"
        " stale-tick alert reads, whatever the Prometheus host's clock says.",
        labels=["name"],
    )
    for name, doc in HISTOGRAMS.items():
        family = HistogramMetricFamily(f"animastor_{name}", doc)
        family.add_metric([], *_buckets(fields, name))
        yield family
        stamp = fields.get(histogram_field(name, "last"))
        if stamp is not None:
            last.add_metric([name], _number(stamp))
            age.add_metric([name], max(0.0, now - _number(stamp)))
    for name, doc in STAGE_HISTOGRAMS.items():
        family = HistogramMetricFamily(f"animastor_{name}", doc, labels=["stage"])
        for stage in stages:
            family.add_metric([stage], *_buckets(fields, f"{name}:{stage}"))
        yield family
    yield last
    yield age


def _buckets(fields: dict[str, str], name: str) -> tuple[list[tuple[str, float]], float]:
    """(cumulative buckets, sum in seconds) of histogram `name` from its non-cumulative fields."""
    buckets: list[tuple[str, float]] = []
    running = 0.0
    for bound in [*buckets_for(name), "+Inf"]:
        stored = bound if isinstance(bound, str) else f"{bound:g}"  # the field name observe() wrote
        running += _number(fields.get(histogram_field(name, f"le={stored}"), "0"))
        buckets.append((stored if isinstance(bound, str) else floatToGoString(bound), running))
    return buckets, _number(fields.get(histogram_field(name, "sum_us"), "0")) / 1_000_000


def _queue_families(rt: Wiring, up: dict[str, float]) -> Iterator[Metric]:
    from animastor_tasks.operator import queue_view

    try:
        running: dict[str, int] | None = rt.reads.lane_usage()
    except Exception as err:  # Postgres's part of the queue view only: the rest is Redis's and the broker's
        # Any failure (a schema not migrated, a privilege withheld) is Postgres's: raised on, it counted as Redis down.
        log.warning("[METRICS] lane usage unreadable: %s", err)
        running, up["postgres"] = None, 0.0
    rows = queue_view.queue_overview(rt, running if running is not None else {})
    consumers = GaugeMetricFamily(
        "animastor_queue_consumers", "Live consumers (heartbeat) per GPU queue.", labels=["queue", "stage"]
    )
    depth = GaugeMetricFamily("animastor_queue_depth", "Messages waiting in each GPU queue.", labels=["queue", "stage"])
    in_flight = GaugeMetricFamily(
        "animastor_queue_in_flight", "Pairs generating per GPU queue (lane usage).", labels=["queue", "stage"]
    )
    lane = GaugeMetricFamily("animastor_queue_lane_limit", "Lane limit per GPU queue.", labels=["queue", "stage"])
    waiting = GaugeMetricFamily(
        "animastor_queue_books_waiting", "Books on each GPU queue's waiting list for a slot.", labels=["queue", "stage"]
    )
    breaker = GaugeMetricFamily(
        "animastor_breaker_state", "Circuit breaker per queue: 1 for its current state.", labels=["queue", "state"]
    )
    deferred = GaugeMetricFamily(
        "animastor_deferred_pairs", "Live deferrals of active books, by bucket.", labels=["bucket"]
    )
    up["broker"] = 1.0
    for row in rows:
        labels = [row["queue"], row["stage"]]
        consumers.add_metric(labels, float(len(row["consumers"])))
        if row["depth"] is None:
            up["broker"] = 0.0
        else:
            depth.add_metric(labels, float(row["depth"]))
        if running is not None:
            in_flight.add_metric(labels, float(row["in_flight"]))
        lane.add_metric(labels, float(row["lane_limit"]))
        waiting.add_metric(labels, float(row["books_waiting"]))
        for state in ("closed", "open", "half-open"):
            breaker.add_metric([row["queue"], state], 1.0 if row["breaker"] == state else 0.0)
    # Every row carries the same totals (deferrals are counted across the active books).
    totals = (
        rows[0]["deferred"]
        if rows
        else rt.deferrals.deferral_counts(rt.ports.book_state.active_books(), rt.ports.clock())
    )
    for bucket, count in sorted(totals.items()):
        deferred.add_metric([bucket], float(count))
    yield from (consumers, depth, in_flight, lane, waiting, breaker, deferred)


def _commands_family(rt: Wiring) -> Metric:
    counts = {str(status): n for status, n in rt.reads.command_status_counts().items()}
    family = GaugeMetricFamily("animastor_commands", "Commands in the registry by status.", labels=["status"])
    for status, n in sorted(counts.items()):
        family.add_metric([status], float(n))
    return family


def _pending_family(pairs: dict[tuple[str, str], int]) -> Metric:
    """The backlog: pairs an active command asked for that no job was dispatched for yet (deferred, waiting
    for a lane, a quota or a scene window slot). Every registered stage is present, zero when idle."""
    counts = {stage: n for (stage, state), n in pairs.items() if state == AssetState.PENDING}
    family = GaugeMetricFamily(
        "animastor_pending_pairs", "Pairs pending (authorized, not dispatched yet) per stage.", labels=["stage"]
    )
    for stage, n in sorted(counts.items()):
        family.add_metric([stage], float(n))
    return family


def _pairs_family(pairs: dict[tuple[str, str], int]) -> Metric:
    """Pairs per stage and asset state across every book; every registered stage x state present, zero when none."""
    family = GaugeMetricFamily("animastor_pairs", "Scene x stage pairs by asset state.", labels=["stage", "state"])
    for (stage, state), n in sorted(pairs.items()):
        family.add_metric([stage, state], float(n))
    return family


def build_registry(wiring: Callable[[], Wiring]) -> CollectorRegistry:
    """A registry holding only our collector (no process metrics of the exporter itself)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AnimastorCollector(wiring))
    return registry


def last_tick_age(settings: Settings | None = None, *, now: float | None = None) -> float | None:
    """Seconds since the beat's last tick was recorded; None when none was or Redis cannot tell.

    A recent tick proves beat, the broker and the control worker are all up: the compose
    healthcheck of beat asks this. It opens one short-lived Redis client and no Postgres pool.
    """
    settings = settings or Settings.from_env()
    conn = RedisConnection(settings.redis_url, Keyspace(settings.key_prefix), socket_timeout=3.0)
    try:
        raw = conn.run(lambda: conn.client.hget(conn.keys.metrics(), histogram_field("tick_seconds", "last")))
        return (conn.server_time() if now is None else now) - float(raw) if raw is not None else None
    except (StoreUnavailable, ValueError):
        return None
    finally:
        conn.close()


def serve(address: str = DEFAULT_ADDRESS, port: int = DEFAULT_PORT) -> None:
    """Serve `/metrics` until SIGINT or SIGTERM."""
    from animastor_tasks.worker.wiring import build

    wired = build(Settings.from_env(), db_wait=SCRAPE_DB_WAIT_SECONDS)
    registry = build_registry(lambda: wired)
    server, thread = start_http_server(port, addr=address, registry=registry)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"[METRICS] serving http://{address}:{server.server_port}/metrics", flush=True)
    while not stop.wait(1.0):
        pass
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
    wired.close()
