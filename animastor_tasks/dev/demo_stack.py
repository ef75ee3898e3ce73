"""The stores and processes one demo run stands on: stores, migrations, a control worker, one worker per
GPU stage, beat, Flower and the metrics exporter, all under one `Supervisor`.

Why apart from the story: whatever point the story reached, `shutdown` must stop exactly what this run
started (its processes, and the embedded stores only when this run started them) and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from animastor_tasks.dev.celery_commands import celery_argv, log_level, worker_argv
from animastor_tasks.dev.local_stores import LocalStores
from animastor_tasks.dev.net import http_ok, port_or_free, port_setting
from animastor_tasks.dev.stores import ensure_stores
from animastor_tasks.dev.supervisor import Supervisor, wait_until
from animastor_tasks.errors import AnimastorError

#: Stage table used when ANIMASTOR_STAGES is unset: the builtin generator with a little work per
#: step, so progress is visible and the whole book still takes a few seconds.
DEMO_STAGES: dict[str, dict[str, Any]] = {
    "audio": {
        "queue": "gpu.audio",
        "input": "text",
        "media_type": "audio/wav",
        "params": {"steps": 4, "step_seconds": 0.04},
    },
    "image": {
        "queue": "gpu.image",
        "input": "prompt",
        "media_type": "image/png",
        "params": {"steps": 4, "step_seconds": 0.04},
    },
}
CONTROL_NAME = "control worker"
BEAT_NAME = "beat"
FLOWER_NAME = "flower"
METRICS_NAME = "metrics exporter"


class DemoError(AnimastorError):
    """The demo could not carry on (a process died, something did not happen in time)."""


def worker_name(stage: str) -> str:
    return f"{stage} worker"


def flower_config_path() -> Path:
    """Flower's `--conf` file: the settings installed with the package (no source checkout needed)."""
    import importlib.util

    spec = importlib.util.find_spec("animastor_tasks.worker.flower_settings")
    if spec is None or spec.origin is None:
        raise DemoError("animastor_tasks.worker.flower_settings is not installed")
    return Path(spec.origin)


class DemoStack:
    """Everything one demo run starts, in `run_dir` (logs in `run_dir/logs`)."""

    def __init__(self, run_dir: Path, say: Callable[[str], None]) -> None:
        self.dir = run_dir
        self.log_dir = run_dir / "logs"
        self.say = say
        self.env: dict[str, str] = dict(os.environ)
        self.supervisor = Supervisor(self.env, self.log_dir, say=say)
        self.settings: Any = None
        self.rt: Any = None
        self.client: Any = None
        self.local_stores: LocalStores | None = None
        self.flower_url = ""
        self.metrics_url = ""
        self.credentials = ""

    def prepare_stores(self) -> None:
        """The configured stores, else local embedded ones; then the runtime and the migrations."""
        from animastor_tasks.adapters.postgres.migrations import migrate
        from animastor_tasks.config import Settings
        from animastor_tasks.worker.wiring import build

        overrides, lines = ensure_stores(self.env, log=self.say)
        self.env.update(overrides)
        if overrides:
            # Stop at the end only the embedded servers this run started; ones found running stay up.
            if any("reusing embedded" in line for line in lines):
                self.say("the local stores were already running: they stay up (`animastor-tasks down` stops them)")
            else:
                self.local_stores = LocalStores()
        self.env.setdefault("ANIMASTOR_STAGES", json.dumps(DEMO_STAGES))
        self.env.setdefault("ANIMASTOR_TICK_SECONDS", "1")
        self.settings = Settings.from_env(self.env)
        self.supervisor.env.update(self.env)
        self.rt = build(self.settings)
        applied = migrate(self.rt.db)
        self.say(f"migrations: {', '.join(applied) if applied else 'database is up to date'}")

    def start_processes(self) -> None:
        """Every process of the stack, then wait until each queue has a consumer and Flower and the exporter
        answer."""
        from animastor_tasks.client import Client
        from animastor_tasks.domain.registry import CONTROL_QUEUE

        stages = self.settings.registry
        busy = {q: sorted(h) for q, h in self.rt.presence.live_consumers(list(stages.queues())).items() if h}
        if busy:
            self.say(f"note: other workers already consume these queues: {busy}; the BLOCKED step may not block")
        flower_address = self.env.get("ANIMASTOR_FLOWER_ADDRESS", "").strip() or "127.0.0.1"
        flower_port = port_or_free(flower_address, port_setting(self.env, "ANIMASTOR_FLOWER_PORT", 5555))
        metrics_port = port_or_free("127.0.0.1", port_setting(self.env, "ANIMASTOR_METRICS_PORT", 9808))
        flower_env = {"ANIMASTOR_FLOWER_ADDRESS": flower_address, "ANIMASTOR_FLOWER_PORT": str(flower_port)}
        if self.env.get("ANIMASTOR_FLOWER_BASIC_AUTH", "").strip():
            self.credentials = "ANIMASTOR_FLOWER_BASIC_AUTH from your environment"
        else:
            path = self.dir / "flower-credentials"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(f"demo:{secrets.token_urlsafe(18)}\n")
            flower_env["ANIMASTOR_FLOWER_BASIC_AUTH"] = path.read_text().strip()
            self.credentials = f"user 'demo', password generated for this run in {path} (mode 600)"

        sup = self.supervisor
        sup.start(CONTROL_NAME, worker_argv(CONTROL_QUEUE, "control@%h", concurrency=2))
        for spec in stages.stages:
            self.start_worker(spec.name)
        sup.start(BEAT_NAME, celery_argv("beat", "-l", log_level()))  # its scheduler keeps no file
        # `animastor-tasks flower`: the packaged settings and their auth rules, as an operator starts it.
        sup.start(FLOWER_NAME, [sys.executable, "-m", "animastor_tasks.operator.cli", "flower"], env=flower_env)
        sup.start(
            METRICS_NAME,
            [sys.executable, "-m", "animastor_tasks.operator.cli", "metrics", "--port", str(metrics_port)],
        )
        names = list(sup.children)
        queues = [CONTROL_QUEUE, *stages.queues()]
        self.wait_consumers(queues, names)
        self.flower_url = f"http://{flower_address}:{flower_port}/"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        wait_until(lambda: http_ok(self.flower_url + "healthcheck"), 30, "Flower", lambda: sup.check(*names))
        wait_until(lambda: http_ok(self.metrics_url), 30, "the metrics exporter", lambda: sup.check(*names))
        self.say(f"all {len(names)} processes are up; every queue has a live consumer")
        self.client = Client(self.settings, timeout=30)

    def start_worker(self, stage: str, env: Mapping[str, str] | None = None) -> None:
        """The GPU worker of `stage`, with `env` on top of the stack's environment."""
        queue = self.settings.registry.get(stage).queue
        self.supervisor.start(worker_name(stage), worker_argv(queue, f"{stage}@%h"), env=env)

    def wait_consumers(self, queues: Sequence[str], names: Sequence[str], timeout: float = 60) -> None:
        def ready() -> bool:
            live = self.rt.presence.live_consumers(list(queues))
            return all(live.get(q) for q in queues)

        wait_until(ready, timeout, f"consumers on {', '.join(queues)}", lambda: self.supervisor.check(*names))

    def shutdown(self) -> None:
        """Stop everything this run started; safe to call at any point."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        self.supervisor.stop_all()
        if self.rt is not None:
            with contextlib.suppress(Exception):
                self.rt.close()
        if self.local_stores is not None:
            for line in self.local_stores.stop():
                self.say(line)
        left = self.supervisor.survivors()
        if left:
            self.say(f"WARNING: processes still alive: {left}")
        else:
            self.say(f"all {self.supervisor.started} process groups stopped; nothing left running")
