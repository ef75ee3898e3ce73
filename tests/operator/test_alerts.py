"""The Grafana dashboard and the Prometheus alert rules (`deploy/`), checked with Debian's real Prometheus.

Why a real Prometheus server: `promtool check rules` proves the rules parse, not that they mean what the
operations guide says. Here the server scrapes the exporter of a running stack every second and evaluates
the rules every second, so the BLOCKED alert is seen firing and resolving through `/api/v1/alerts`, and
every dashboard query is run by the same server.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from animastor_tasks.dev.net import free_port
from tests.support import missing, wait_for
from tests.support.stack import Stack

from . import http_get, make_book, operator_env
from .test_metrics import Samples, scrape

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"  # unit tests of the rules: alerts_test.yml beside it
DASHBOARD = ROOT / "deploy" / "grafana" / "animastor.json"
#: What Grafana substitutes in the dashboard's queries, for running them against Prometheus directly.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$stage": ".*"}


def tool(name: str) -> str:
    """The path of a Prometheus binary (Debian's `prometheus` package ships both)."""
    path = shutil.which(name)
    if path is None:
        missing(f"{name} not installed (apt-get install prometheus)")
    return path


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def rule_count() -> int:
    return len(re.findall(r"^\s*- alert:", RULES.read_text(), re.MULTILINE))


def metric_names(texts: list[str]) -> set[str]:
    """The metric names in PromQL (or a whole rules file: its annotations name only real metrics too)."""
    return {name for text in texts for name in re.findall(r"\banimastor_[a-z_]+\b", text)}


def test_rules_pass_promtool() -> None:
    done = subprocess.run(
        [tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=30, check=False
    )
    print(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {rule_count()} rules found" in done.stdout


def test_rules_mean_what_the_guide_says() -> None:
    """`deploy/prometheus/alerts_test.yml`: breaker, backlog without consumer, stale tick, failing jobs on
    synthetic series (the BLOCKED alert runs against a real stack below)."""
    done = subprocess.run(
        [tool("promtool"), "test", "rules", "alerts_test.yml"],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_dashboard_panels_query_the_prometheus_datasource() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "animastor-tasks"
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "stage"]
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]


def prom_get(base: str, path: str, **params: str) -> Any:
    status, body = http_get(f"{base}{path}?{urllib.parse.urlencode(params)}")
    assert status == 200, f"{path} {params}: {status} {body[:500]}"
    answer = json.loads(body)
    assert answer["status"] == "success", answer
    return answer["data"]


def alerts(base: str, name: str) -> list[dict[str, Any]]:
    return [a for a in prom_get(base, "/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == name]


@pytest.fixture(scope="module")
def watched_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str, str]]:
    """A stack (control, audio, image, beat with a 1 s tick), its exporter and a Prometheus scraping it:
    (stack, exporter URL, Prometheus base URL). Prometheus is stopped and its storage removed at the end."""
    prometheus = tool("prometheus")
    folder = tmp_path_factory.mktemp("alerts")
    with operator_env(folder, ANIMASTOR_TICK_SECONDS="1") as env:
        stack = Stack(env, folder)
        storage = folder / "tsdb"
        try:
            exporter, prom = free_port(), free_port()
            stack.supervisor.start(
                "metrics", [sys.executable, "-m", "animastor_tasks.operator.cli", "metrics", "--port", str(exporter)]
            )
            config = folder / "prometheus.yml"
            config.write_text(
                json.dumps(  # JSON is YAML
                    {
                        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                        "rule_files": [str(RULES)],
                        "scrape_configs": [
                            {"job_name": "animastor", "static_configs": [{"targets": [f"127.0.0.1:{exporter}"]}]}
                        ],
                    }
                )
            )
            stack.supervisor.start(
                "prometheus",
                [
                    prometheus,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={storage}",
                    f"--web.listen-address=127.0.0.1:{prom}",
                    "--log.level=warn",
                ],
            )
            stack.start_control()
            stack.start_gpu("audio")
            stack.start_gpu("image")
            stack.start_beat()
            base = f"http://127.0.0.1:{prom}"
            wait_for(lambda: http_get(f"{base}/-/ready")[0] == 200, 30, "Prometheus ready")
            stack.wait_consumers("animastor.control", "gpu.audio", "gpu.image")
            yield stack, f"http://127.0.0.1:{exporter}/metrics", base
            server = stack.supervisor.children["prometheus"]
            stack.supervisor.stop("prometheus")
            assert server.process.returncode == 0, f"Prometheus stopped unclean:\n{server.tail()}"
        finally:
            stack.close()
            shutil.rmtree(storage, ignore_errors=True)


def test_every_metric_of_the_dashboard_and_the_rules_is_exported(watched_stack: tuple[Stack, str, str]) -> None:
    _, exporter, base = watched_stack

    def ticked() -> Samples | None:
        samples = scrape(exporter)
        stamp = ("animastor_last_observation_timestamp_seconds", (("name", "tick_seconds"),))
        return samples if stamp in samples else None

    samples = wait_for(ticked, 15, "a beat tick recorded")
    exported = {name for name, _ in samples}
    used = metric_names([*dashboard_queries(), RULES.read_text()])
    assert used - exported == set(), f"used by the dashboard or the rules, not exported: {sorted(used - exported)}"
    assert {"animastor_job_seconds_bucket", "animastor_queue_wait_seconds_bucket", "animastor_pairs"} <= used
    # Prometheus itself runs every dashboard query (Grafana's variables substituted) and every rule.
    wait_for(lambda: "animastor_pairs" in prom_get(base, "/api/v1/label/__name__/values"), 15, "first scrape")
    for query in dashboard_queries():
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        prom_get(base, "/api/v1/query", query=query)

    def evaluated() -> list[dict[str, Any]] | None:
        rules = [r for g in prom_get(base, "/api/v1/rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules) else None

    rules = wait_for(evaluated, 15, "every rule evaluated")
    assert [(r["name"], r["health"]) for r in rules if r["health"] != "ok"] == []
    assert len(rules) == rule_count()


def test_blocked_alert_fires_while_a_stage_has_no_worker(watched_stack: tuple[Stack, str, str]) -> None:
    stack, _, base = watched_stack
    assert alerts(base, "AnimastorStageBlocked") == []
    book = f"a-{uuid.uuid4().hex[:6]}"
    stack.rt.catalog.import_book(make_book(book, scenes=2))
    stack.supervisor.stop("image", first=signal.SIGKILL)  # its host lost (a clean stop is waited out as a restart)
    wait_for(lambda: not stack.rt.presence.live_consumers(["gpu.image"]).get("gpu.image"), 15, "no image consumer")
    blocked_id = stack.client.regenerate(book, ["image"])["commands"][0]["command_id"]
    wait_for(
        lambda: stack.rt.ports.commands.commands(command_ids=[blocked_id])[0].status == "blocked",
        30,
        "command BLOCKED",
    )
    blocked_at = time.monotonic()
    firing = wait_for(
        lambda: [a for a in alerts(base, "AnimastorStageBlocked") if a["state"] == "firing"],
        20,
        "AnimastorStageBlocked firing",
        interval=0.2,
    )
    fired_after = time.monotonic() - blocked_at
    assert [a["labels"]["stage"] for a in firing] == ["image"], firing
    assert firing[0]["labels"]["severity"] == "critical"
    assert "animastor-tasks worker --stage image" in firing[0]["annotations"]["description"]

    stack.start_gpu("image")
    stack.wait_consumers("gpu.image")
    back_at = time.monotonic()
    wait_for(lambda: alerts(base, "AnimastorStageBlocked") == [], 20, "AnimastorStageBlocked resolved", interval=0.2)
    resolved_after = time.monotonic() - back_at
    print(
        f"[FIGURE] AnimastorStageBlocked firing {fired_after:.1f}s after the command was BLOCKED,"
        f" resolved {resolved_after:.1f}s after the image worker was back (scrape and evaluation every 1s)"
    )
