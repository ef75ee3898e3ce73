"""The Prometheus exporter: histogram arithmetic in-process, then real scrapes over HTTP while real workers work."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from animastor_tasks.dev.net import free_port
from animastor_tasks.flow import dispatch
from animastor_tasks.operator import metrics
from animastor_tasks.worker.wiring import Wiring
from tests.support import wait_for
from tests.support.silent_server import silent_server
from tests.support.stack import Stack

from . import http_get, make_book, operator_env

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, metric: str, **labels: str) -> float:
    key = (metric, tuple(sorted(labels.items())))
    assert key in samples, f"{metric}{labels} not exported; have {sorted(k for k in samples if k[0] == metric)}"
    return samples[key]


def test_observations_become_a_cumulative_histogram(rt: Wiring) -> None:
    for seconds in (0.003, 0.2, 0.2, 20.0):
        rt.counters.observe("gate_pass_seconds", seconds)
    samples = parse(generate_latest(metrics.build_registry(lambda: rt)).decode())
    bucket = "animastor_gate_pass_seconds_bucket"
    assert value(samples, bucket, le="0.005") == 1
    assert value(samples, bucket, le="0.1") == 1
    assert value(samples, bucket, le="0.25") == 3
    assert value(samples, bucket, le="10.0") == 3
    assert value(samples, bucket, le="+Inf") == 4
    assert value(samples, "animastor_gate_pass_seconds_count") == 4
    assert value(samples, "animastor_gate_pass_seconds_sum") == pytest.approx(20.403)
    assert value(samples, "animastor_tick_seconds_count") == 0
    assert value(samples, "animastor_reconcile_seconds_count") == 0
    assert value(samples, "animastor_last_observation_timestamp_seconds", name="gate_pass_seconds") > 0
    assert 0 <= value(samples, "animastor_last_observation_age_seconds", name="gate_pass_seconds") < 60
    assert value(samples, "animastor_store_up", store="redis") == 1


def test_last_tick_age_follows_the_beat_tick(rt: Wiring) -> None:
    """What the compose healthcheck of beat asks: no tick yet, a fresh tick, then Redis unreachable."""
    from dataclasses import replace

    from animastor_tasks.flow import gate

    assert metrics.last_tick_age(rt.settings) is None
    gate.tick(rt.ports)
    wait_for(lambda: metrics.last_tick_age(rt.settings) is not None, 5, "the tick's observation written out")
    age = metrics.last_tick_age(rt.settings)
    assert age is not None and 0 <= age < 5  # stamped at the tick, not when the process wrote it out
    assert metrics.last_tick_age(rt.settings, now=time.time() + 60) == pytest.approx(age + 60, abs=1)
    assert metrics.last_tick_age(replace(rt.settings, redis_url="redis://127.0.0.1:1/0")) is None


def test_counters_of_the_hash_are_exported_by_kind(rt: Wiring) -> None:
    dispatch.count_outcomes(rt.ports, {"dispatched": 3, "fence_rejected": 2, "deferred_capacity": 7})
    rt.counters.add({"blocked:image": 1})
    rt.counters.add({"job:ready:audio": 5})
    rt.counters.add({"lost_refill:audio": 2, "late_refill:image": 4})
    samples = parse(generate_latest(metrics.build_registry(lambda: rt)).decode())
    assert value(samples, "animastor_dispatch_outcomes_total", outcome="dispatched") == 3
    assert value(samples, "animastor_dispatch_outcomes_total", outcome="lane_full") == 0  # known labels start at 0
    assert value(samples, "animastor_fence_rejections_total") == 2
    assert value(samples, "animastor_blocked_commands_total", stage="image") == 1
    assert value(samples, "animastor_blocked_commands_total", stage="audio") == 0
    assert value(samples, "animastor_jobs_total", event="ready", stage="audio") == 5
    assert value(samples, "animastor_jobs_total", event="ready", stage="image") == 0
    assert value(samples, "animastor_lost_refills_total", stage="audio") == 2
    assert value(samples, "animastor_lost_refills_total", stage="image") == 0
    assert value(samples, "animastor_late_refills_total", stage="image") == 4
    assert value(samples, "animastor_late_refills_total", stage="audio") == 0
    assert value(samples, "animastor_commands", status="active") == 0
    # Exported at 0 before the first failure, as the others: `increase()` missed the first failed revoke.
    assert value(samples, "animastor_revoke_failures_total") == 0
    assert value(samples, "animastor_lost_gate_passes_total") == 0
    rt.counters.add({"lost_pass": 3})
    samples = parse(generate_latest(metrics.build_registry(lambda: rt)).decode())
    assert value(samples, "animastor_lost_gate_passes_total") == 3


def test_a_postgres_error_that_is_no_outage_is_still_blamed_on_postgres(rt: Wiring, monkeypatch) -> None:
    """A database without its schema (or a read it may not make) raised past the queue view's Postgres read:
    counted as Redis down, with the consumer and depth families (the alerts' inputs) dropped."""
    import psycopg

    def no_table() -> dict[str, int]:
        raise psycopg.errors.UndefinedTable('relation "asset_states" does not exist')

    monkeypatch.setattr(rt.reads, "lane_usage", no_table)
    samples = parse(generate_latest(metrics.build_registry(lambda: rt)).decode())
    assert value(samples, "animastor_store_up", store="redis") == 1
    assert value(samples, "animastor_store_up", store="postgres") == 0
    assert value(samples, "animastor_queue_consumers", queue="gpu.audio", stage="audio") == 0


def test_pending_backlog_is_exported_per_stage(rt: Wiring) -> None:
    from animastor_tasks.flow import regenerate
    from tests.integration.helpers import advertise
    from tests.integration.test_commands import cap_books

    samples = parse(generate_latest(metrics.build_registry(lambda: rt)).decode())
    assert value(samples, "animastor_pending_pairs", stage="audio") == 0  # every stage, from the first scrape
    assert value(samples, "animastor_pending_pairs", stage="image") == 0
    rt.catalog.import_book(make_book("backlog", scenes=6))
    advertise(rt, "gpu.audio")
    cap_books(rt, 4)  # a hard cap: four dispatched, two wait (a lone book passes its fair share)
    regenerate.regenerate(rt.ports, "backlog", ["audio"])
    samples = parse(generate_latest(metrics.build_registry(lambda: rt)).decode())
    assert value(samples, "animastor_pending_pairs", stage="audio") == 2
    assert value(samples, "animastor_pending_pairs", stage="image") == 0
    assert value(samples, "animastor_store_up", store="postgres") == 1


def scrape(url: str) -> Samples:
    status, body = http_get(url)
    assert status == 200, body
    return parse(body)


@pytest.fixture
def exporter_stack(tmp_path: Path) -> Iterator[tuple[Stack, str]]:
    """Control + GPU workers + beat (1 s tick) and `animastor-tasks metrics` as a subprocess."""
    with operator_env(tmp_path, ANIMASTOR_TICK_SECONDS="1") as env:
        stack = Stack(env, tmp_path)
        try:
            port = free_port()
            stack.supervisor.start(
                "metrics", [sys.executable, "-m", "animastor_tasks.operator.cli", "metrics", "--port", str(port)]
            )
            stack.start_control()
            stack.start_gpu("audio")
            stack.start_gpu("image")
            stack.start_beat()
            url = f"http://127.0.0.1:{port}/metrics"
            wait_for(lambda: http_get(url)[0] == 200, 30, "the exporter answers")
            stack.wait_consumers("animastor.control", "gpu.audio", "gpu.image")
            yield stack, url
        finally:
            stack.close()
    log = (tmp_path / "logs" / "metrics.log").read_text()
    assert f"serving http://127.0.0.1:{port}/metrics" in log  # loopback unless told otherwise


def test_scrapes_follow_real_work(exporter_stack: tuple[Stack, str]) -> None:
    from animastor_tasks.client import Client

    stack, url = exporter_stack
    before = scrape(url)
    assert value(before, "animastor_queue_consumers", queue="gpu.audio", stage="audio") == 1
    assert value(before, "animastor_queue_consumers", queue="gpu.image", stage="image") == 1
    assert value(before, "animastor_commands", status="completed") == 0
    assert value(before, "animastor_jobs_total", event="ready", stage="audio") == 0

    book = f"m-{uuid.uuid4().hex[:6]}"
    stack.rt.catalog.import_book(make_book(book, scenes=3))
    client = Client(stack.settings, timeout=30)
    try:
        ids = [c["command_id"] for c in client.regenerate(book, ["all"])["commands"]]

        def completed() -> bool:
            rows = stack.rt.ports.commands.commands(command_ids=ids)
            return len(rows) == 2 and all(r.status == "completed" for r in rows)

        wait_for(completed, 60, "both commands completed")

        def counted() -> Samples | None:  # each process writes its counts out within a second
            samples = scrape(url)
            ready = [value(samples, "animastor_jobs_total", event="ready", stage=s) for s in ("audio", "image")]
            # The idle pairs are counted again once 200 times their last count's duration has passed (IdlePairs).
            ready += [value(samples, "animastor_pairs", stage=s, state="ready") for s in ("audio", "image")]
            return samples if value(samples, "animastor_tick_seconds_count") > 0 and ready == [3] * 4 else None

        after = wait_for(counted, 30, "a beat tick, every job counted and the ready pairs counted again")
        assert value(after, "animastor_commands", status="completed") == 2
        for stage in ("audio", "image"):
            assert value(after, "animastor_jobs_total", event="started", stage=stage) == 3
            assert value(after, "animastor_jobs_total", event="ready", stage=stage) == 3
            assert value(after, "animastor_job_seconds_count", stage=stage) == 3
            assert value(after, "animastor_queue_wait_seconds_count", stage=stage) == 3
            assert value(after, "animastor_pairs", stage=stage, state="ready") == 3
        assert value(after, "animastor_dispatch_outcomes_total", outcome="dispatched") >= 6
        assert value(after, "animastor_gate_pass_seconds_count") >= 1
        assert value(after, "animastor_gate_pass_seconds_bucket", le="+Inf") == value(
            after, "animastor_gate_pass_seconds_count"
        )
        assert value(after, "animastor_queue_depth", queue="gpu.audio", stage="audio") == 0
        assert value(after, "animastor_queue_in_flight", queue="gpu.image", stage="image") == 0
        for store in ("redis", "postgres", "broker"):
            assert value(after, "animastor_store_up", store=store) == 1

        # The image worker's host goes away: the next image command is BLOCKED, and the scrape says so.
        stack.supervisor.stop("image", first=signal.SIGKILL)
        wait_for(
            lambda: value(scrape(url), "animastor_queue_consumers", queue="gpu.image", stage="image") == 0,
            15,
            "no image consumer",
        )
        blocked_id = client.regenerate(book, ["image"])["commands"][0]["command_id"]
        wait_for(
            lambda: stack.rt.ports.commands.commands(command_ids=[blocked_id])[0].status == "blocked",
            30,
            "command BLOCKED",
        )

        def block_counted() -> Samples | None:  # its command and its pairs' outcomes, counted apart, written apart
            samples = scrape(url)
            commands = value(samples, "animastor_blocked_commands_total", stage="image")
            pairs = value(samples, "animastor_dispatch_outcomes_total", outcome="blocked")
            return samples if commands and pairs else None

        blocked = wait_for(block_counted, 5, "the block counted")
    finally:
        client.close()
    assert value(blocked, "animastor_blocked_commands_total", stage="image") == 1
    assert value(blocked, "animastor_commands", status="blocked") == 1
    assert value(blocked, "animastor_dispatch_outcomes_total", outcome="blocked") == 3
    assert value(blocked, "animastor_queue_consumers", queue="gpu.audio", stage="audio") == 1


def scrape_with_a_store_down(env: dict[str, str], **down: str) -> Samples:
    """One scrape of `animastor-tasks metrics` (a subprocess) run with the `down` variables pointing at nothing;
    the exporter must then stop cleanly on SIGTERM."""
    return timed_scrape_with_a_store_down(env, **down)[0]


def timed_scrape_with_a_store_down(env: dict[str, str], **down: str) -> tuple[Samples, float]:
    """`scrape_with_a_store_down`, and how long a scrape took once the exporter had answered one (each is given
    Prometheus's default scrape timeout, 10 s)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "animastor_tasks.operator.cli", "metrics", "--port", str(port)],
        env={**env, **down},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_for(lambda: http_get(url, timeout=10)[0] == 200, 30, "the exporter answers")
        started = time.monotonic()
        status, body = http_get(url, timeout=10)
        assert status == 200, body
        return parse(body), time.monotonic() - started
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0  # SIGTERM is a clean stop


def test_a_redis_outage_is_reported_not_fatal(tmp_path: Path) -> None:
    """Redis down: the scrape still answers 200, with `animastor_store_up{store="redis"} 0`."""
    with operator_env(tmp_path) as env:
        dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
        samples = scrape_with_a_store_down(env, ANIMASTOR_REDIS_URL=dead, ANIMASTOR_BROKER_URL=dead)
    assert value(samples, "animastor_store_up", store="redis") == 0
    assert value(samples, "animastor_store_up", store="postgres") == 1
    assert value(samples, "animastor_commands", status="active") == 0
    ready = ("animastor_jobs_total", (("event", "ready"), ("stage", "audio")))
    assert ready not in samples  # unknown, not a made-up 0


def test_a_postgres_outage_is_blamed_on_postgres_and_keeps_the_queue_families(tmp_path: Path) -> None:
    """Postgres down: the queue view's lane usage (a Postgres read) failed the whole queue section, which was
    counted as Redis down, and the consumer, depth, breaker and deferral families were dropped with it; and the
    scrape waited for Postgres twice (5 s each), past Prometheus' scrape timeout."""
    with operator_env(tmp_path) as env:
        dead = f"postgresql://postgres@127.0.0.1:{free_port()}/animastor"  # nothing listens there
        samples = scrape_with_a_store_down(env, ANIMASTOR_DATABASE_URL=dead)
    assert value(samples, "animastor_store_up", store="postgres") == 0
    assert value(samples, "animastor_store_up", store="redis") == 1
    assert value(samples, "animastor_store_up", store="broker") == 1
    assert value(samples, "animastor_queue_lane_limit", queue="gpu.audio", stage="audio") > 0
    assert value(samples, "animastor_breaker_state", queue="gpu.audio", state="closed") == 1
    in_flight = ("animastor_queue_in_flight", (("queue", "gpu.audio"), ("stage", "audio")))
    assert in_flight not in samples  # unknown, not a made-up 0


@pytest.mark.parametrize("scheme", ["amqp://guest:guest@", "redis://"])
def test_a_broker_that_never_answers_is_reported_within_a_scrape_timeout(tmp_path: Path, scheme: str) -> None:
    """A broker that takes connections and never answers (paused, or hung behind a load balancer) held each AMQP
    probe 4 s a queue, and a Redis one for ever: the scrape outran Prometheus's 10 s timeout, and every series,
    `animastor_store_up{store="broker"}` with them, went stale during the very outage it is there to show."""
    with operator_env(tmp_path) as env, silent_server() as port:
        samples, took = timed_scrape_with_a_store_down(env, ANIMASTOR_BROKER_URL=f"{scheme}127.0.0.1:{port}/0")
    assert value(samples, "animastor_store_up", store="broker") == 0
    assert value(samples, "animastor_store_up", store="postgres") == 1
    assert took < 10, took


@pytest.mark.parametrize("port", ["abc", "70000"])
def test_a_bad_port_in_the_environment_is_named(port: str) -> None:
    """Click blamed `--port`, which an operator who set only ANIMASTOR_METRICS_PORT never typed."""
    from click.testing import CliRunner

    from animastor_tasks.operator.cli import main

    done = CliRunner().invoke(main, ["metrics"], env={"ANIMASTOR_METRICS_PORT": port})
    assert done.exit_code == 2 and "ANIMASTOR_METRICS_PORT" in done.output, done.output
