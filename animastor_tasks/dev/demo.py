"""`animastor-tasks demo` (`make demo`): the whole system on one machine, scripted, in well under a minute.

The story: stores (the configured ones, else local embedded ones) -> migrate -> a control worker,
one worker per GPU stage, beat, Flower and the metrics exporter -> import the sample book ->
`regenerate --stage all` with live progress -> a BLOCKED command (the image worker is stopped)
-> Stop All in the middle of a slow run -> where the artifacts, Flower and the metrics are.

Every process runs in a process group of its own under the `Supervisor` (see dev/supervisor.py): a
terminal's Ctrl-C reaches only the demo, which then stops every group itself, pool children included,
on a normal exit, Ctrl-C or SIGTERM alike; a second Ctrl-C skips the grace period. Each child carries
`ANIMASTOR_SUPERVISOR=<token>` in its environment so that anyone (the tests do) can find a survivor.
Logs go to `<run dir>/logs/<process>.log`.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from animastor_tasks.dev.demo_progress import render_progress
from animastor_tasks.dev.demo_stack import DEMO_STAGES, DemoError, DemoStack, worker_name
from animastor_tasks.dev.local_dir import default_data_dir
from animastor_tasks.dev.supervisor import Interrupted, SupervisorError, wait_until
from animastor_tasks.domain.vocabulary import IN_FLIGHT, NO_LONGER_ACTIVE, AssetState, CommandStatus

#: Seconds per step of the slowed-down worker of the Stop All part (4 steps: 2 s per scene).
SLOW_STEP_SECONDS = 0.5


def slowed(table: Mapping[str, Any], stage: str, step_seconds: float) -> dict[str, Any]:
    """The stage table with `stage` made slow (its generator sleeps `step_seconds` per step)."""
    copy = json.loads(json.dumps(table))
    copy[stage]["params"] = {**copy[stage].get("params", {}), "step_seconds": step_seconds}
    return copy


@dataclass
class Demo:
    keep_running: bool = False
    run_dir: Path | None = None
    console: Console = field(default_factory=Console)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self.stack = DemoStack((self.run_dir or default_data_dir() / "demo").resolve(), say=self.say)
        self.supervisor = self.stack.supervisor
        self.stopping = False

    # -- output ---------------------------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.console.print(f"[DEMO] {text}", highlight=False, markup=False, soft_wrap=True)

    def step(self, title: str) -> None:
        elapsed = time.monotonic() - self.started
        self.console.rule(f"[bold]{title}[/bold] [dim](t={elapsed:.1f}s)[/dim]")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.timings[name] = time.monotonic() - started

    # -- main -----------------------------------------------------------------------------------------------------

    def run(self) -> int:
        log_dir = self.stack.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        for old in log_dir.glob("*.log"):
            old.unlink()
        self.say(f"run directory {self.stack.dir} (supervisor token {self.supervisor.token})")
        with self.phase("stores"):
            self.step("1. stores")
            self.stack.prepare_stores()
        with self.phase("processes"):
            self.step("2. processes: control worker, one worker per GPU stage, beat, Flower, metrics")
            self.stack.start_processes()
        with self.phase("import"):
            book = self.import_book()
        with self.phase("regenerate all"):
            self.regenerate_all(book)
        with self.phase("blocked"):
            self.show_blocked(book)
        with self.phase("stop all"):
            self.show_stop_all(book)
        self.summary()
        if self.keep_running:
            self.stay_up()
        return 0

    def import_book(self) -> str:
        from animastor_tasks.dev.samples import load_sample_book, sample_book_path
        from animastor_tasks.flow import layers as layers_flow

        rt, settings = self.stack.rt, self.stack.settings
        self.step("3. import the sample book")
        book = load_sample_book()
        summary = rt.catalog.import_book(book)
        scenes = sum(len(c.scenes) for c in book.chapters)
        self.say(
            f"{'imported' if summary.created else 're-imported'} {book.book_id!r} from {sample_book_path()}: "
            f"{len(book.chapters)} chapters, {scenes} scenes"
        )
        layers = layers_flow.set_layers(rt.ports, book.book_id, list(settings.registry.names()), [])
        self.say("layers: " + ", ".join(f"{k}={'on' if v else 'off'}" for k, v in layers.items()))
        busy = [s for *_, s, _ in rt.ports.assets.scene_states(book.book_id) if s in IN_FLIGHT]
        if busy:
            self.say(f"{len(busy)} pair(s) still in flight from an earlier run: Stop All first, for a clean start")
            self.stack.client.cancel(book.book_id, "demo: clean start")
        return str(book.book_id)

    def regenerate(self, book: str, stages: list[str]) -> list[str]:
        stage_text = " ".join(f"--stage {s}" for s in stages)
        self.say(f"$ animastor-tasks regenerate {book} {stage_text}")
        result = self.stack.client.regenerate(book, stages)
        for skipped in result["skipped"]:
            self.say(f"skipped {skipped['stage']}: {skipped['reason']}")
        return [str(c["command_id"]) for c in result["commands"]]

    def watch(
        self, command_ids: list[str], timeout: float, until: Callable[[list[Any]], bool] | None = None
    ) -> list[Any]:
        """Live progress bars until every command is terminal (or `until` holds)."""
        names = list(self.supervisor.children)
        commands = self.stack.rt.ports.commands

        def done(rows: list[Any]) -> bool:
            return all(r.status in NO_LONGER_ACTIVE for r in rows) or (until is not None and until(rows))

        deadline = time.monotonic() + timeout
        rows = commands.commands(command_ids=command_ids)
        with Live(render_progress(rows), console=self.console, refresh_per_second=8) as live:
            while not done(rows):
                if time.monotonic() > deadline:
                    raise DemoError(
                        f"commands not finished after {timeout:.0f}s: {[(r.stage, r.status) for r in rows]}"
                    )
                self.supervisor.check(*names)
                time.sleep(0.2)
                rows = commands.commands(command_ids=command_ids)
                live.update(render_progress(rows))
        if not self.console.is_terminal:
            self.console.line()  # a log or a pipe gets the final bars without their closing newline
        return rows

    def regenerate_all(self, book: str) -> None:
        self.step("4. regenerate --stage all: one command per stage, jobs on the GPU queues")
        started = time.monotonic()
        rows = self.watch(self.regenerate(book, ["all"]), timeout=60)
        for row in rows:
            self.say(f"{row.stage}: {row.status}, {row.progress.get('ready', 0)}/{row.targets} ready")
        if any(r.status != CommandStatus.COMPLETED for r in rows):
            raise DemoError(f"regenerate --stage all did not complete: {[(r.stage, r.status) for r in rows]}")
        self.say(f"whole book generated in {time.monotonic() - started:.1f}s")

    def show_blocked(self, book: str) -> None:
        rt, settings = self.stack.rt, self.stack.settings
        stage = "image" if "image" in settings.registry else settings.registry.names()[-1]
        spec = settings.registry.get(stage)
        self.step(f"5. BLOCKED: no worker consumes {spec.queue}")
        # Killed, not stopped: a worker stopped cleanly is taken for a restart, and its stage waits for a successor.
        self.say(f"killing the {stage} worker (as if its GPU host went away)")
        self.supervisor.stop(worker_name(stage), first=signal.SIGKILL)
        wait_until(
            lambda: not rt.presence.live_consumers([spec.queue]).get(spec.queue),
            settings.presence_ttl_seconds + 5,
            f"{spec.queue} to lose its consumer",
        )
        rows = self.watch(self.regenerate(book, [stage]), timeout=30)
        for row in rows:
            self.say(f"command {row.command_id[:8]} ({row.stage}): {row.status.upper()} reason={row.reason}")
        if not rows or rows[0].status != CommandStatus.BLOCKED:
            raise DemoError(f"expected a BLOCKED command, got {[(r.status, r.reason) for r in rows]}")
        self.say(
            f"how to fix: start a worker for the stage (`animastor-tasks worker --stage {stage}`), "
            "then send the command again; a BLOCKED command is never retried on its own"
        )
        self.stack.start_worker(stage)
        self.say(f"restarted the {stage} worker (`animastor-tasks queues` shows its consumer again)")

    def show_stop_all(self, book: str) -> None:
        rt, settings, env = self.stack.rt, self.stack.settings, self.stack.env
        stage = "audio" if "audio" in settings.registry else settings.registry.names()[0]
        self.step(f"6. Stop All in the middle of a slow {stage} run")
        table = json.loads(env["ANIMASTOR_STAGES"]) if env.get("ANIMASTOR_STAGES") else DEMO_STAGES
        slow = json.dumps(slowed(table, stage, SLOW_STEP_SECONDS))
        self.say(f"restarting the {stage} worker with a slow generator (step_seconds={SLOW_STEP_SECONDS})")
        self.supervisor.stop(worker_name(stage))
        self.stack.start_worker(stage, env={"ANIMASTOR_STAGES": slow})
        queues = [q for q in settings.registry.queues()]
        self.stack.wait_consumers(queues, list(self.supervisor.children))
        ids = self.regenerate(book, [stage])
        self.watch(ids, timeout=60, until=lambda rows: sum(r.progress.get(AssetState.READY, 0) for r in rows) >= 1)
        self.say(f"$ animastor-tasks cancel {book}   (Stop All)")
        result = self.stack.client.cancel(book, "demo: Stop All")
        self.say(
            f"cancelled {len(result['cancelled_commands'])} command(s), released {result['released']} pair(s), "
            f"revoked {result['revoked']} job(s)"
        )

        def settled() -> bool:
            return not any(s == AssetState.GENERATING for *_, s, _ in rt.ports.assets.scene_states(book))

        wait_until(settled, 10, "the book to have no generating pair")
        time.sleep(0.5)  # the running job notices the flag within its watcher's poll (0.25 s)
        rows = rt.ports.commands.commands(command_ids=ids)
        self.console.print(render_progress(rows))
        states: dict[str, int] = {}
        for _, _, st, state, _ in rt.ports.assets.scene_states(book):
            if st == stage:
                states[state] = states.get(state, 0) + 1
        self.say(f"{stage} after Stop All: " + ", ".join(f"{k}={v}" for k, v in sorted(states.items())))
        if any(r.status != CommandStatus.CANCELLED for r in rows) or any(states.get(s) for s in IN_FLIGHT):
            raise DemoError(f"Stop All left work behind: {states}, {[r.status for r in rows]}")
        self.say("nothing of the book is queued or running; only a new regenerate starts work again")
        if self.keep_running:
            self.supervisor.stop(worker_name(stage))
            self.stack.start_worker(stage)

    def summary(self) -> None:
        self.step("7. where things are")
        root = Path(self.stack.settings.artifact_root).expanduser()
        root = root if root.is_absolute() else Path.cwd() / root
        files = sum(1 for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
        table = Table(show_header=False, box=None)
        table.add_row("artifacts", f"{root} ({files} files, named by sha256)")
        table.add_row("Flower", f"{self.stack.flower_url} (basic auth: {self.stack.credentials})")
        table.add_row("metrics", f"{self.stack.metrics_url} (Prometheus text format)")
        table.add_row("logs", str(self.stack.log_dir))
        table.add_row("timings", ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items()))
        table.add_row("total", f"{time.monotonic() - self.started:.1f}s")
        self.console.print(table)

    def stay_up(self) -> None:
        self.say("--keep-running: the stack stays up; press Ctrl-C to stop every process")
        names = list(self.supervisor.children)
        while True:
            self.supervisor.check(*names)
            time.sleep(1)

    def shutdown(self) -> None:
        """Stop everything this run started; safe to call at any point of the story."""
        self.stopping = True
        self.step("shutdown")
        self.stack.shutdown()


def main(*, keep_running: bool = False, run_dir: Path | None = None) -> int:
    """Run the demo; 0 when the story completed, 128+N after signal N, raises on a store/broker outage."""
    demo = Demo(keep_running=keep_running, run_dir=run_dir)
    sup = demo.supervisor

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if demo.stopping:
            sup.hurry = True  # a second Ctrl-C: no more waiting for graceful exits
            return
        sup.on_signal(signum, frame)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        try:
            code = demo.run()
        except Interrupted as err:
            demo.say(f"{err} received: stopping everything this demo started")
            code = 128 + err.signum
        except (DemoError, SupervisorError) as err:
            demo.say(f"error: {err}")
            code = 1
        except Exception as err:
            if (signalled := Interrupted.behind(err)) is None:
                raise
            demo.say(f"{signalled} received: stopping everything this demo started")
            code = 128 + signalled.signum
    finally:
        demo.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
