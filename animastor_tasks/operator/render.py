"""What the CLI shows people: command progress (with rate and ETA when watching), every scene's
state per stage, the recent commands and the queue overview.

Each view is built as a rich renderable first and printed second, so tests render it to a string.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from animastor_tasks.contract import BookStatus, QueueRow
from animastor_tasks.domain.vocabulary import NO_LONGER_ACTIVE, AssetState
from animastor_tasks.errors import StoreUnavailable

# Progress columns, most finished first.
STATES = (AssetState.READY, AssetState.GENERATING, AssetState.PENDING, AssetState.DIRTY, AssetState.FAILED)
# One cell per (scene, stage): a glyph that still reads without colour (tmux captures, logs), and a colour.
CELLS: dict[str, tuple[str, str]] = {
    AssetState.READY: ("●", "green"),
    AssetState.GENERATING: ("◐", "bold yellow"),
    AssetState.PENDING: ("○", "cyan"),
    AssetState.DIRTY: ("·", "dim"),
    AssetState.FAILED: ("✗", "bold red"),
}
MISSING_CELL = (" ", "")
# Above this many chapters one row per chapter gets too tall: each stage becomes one wrapped strip.
CHAPTER_ROWS_MAX = 24
RATE_WINDOW_SECONDS = 60.0
FAILURES_SHOWN = 10  # failed pairs listed with their error under the grid; `status --json` has every one
PIPED_WIDTH = 4096  # columns printed to a pipe or a file: a row of the longest id and reason fits


class RateMeter:
    """Finished targets per second of each command over a sliding window, and the ETA it implies.

    Why a window and not the average since creation: a command may wait for a slot a long time
    before its first job starts; the recent pace is what predicts the rest."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS) -> None:
        self.window = window
        self.samples: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, data: Mapping[str, Any], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for c in data["commands"]:
            p = c["progress"]
            samples = self.samples.setdefault(c["command_id"], deque())
            samples.append((now, p.get("ready", 0) + p.get("failed", 0)))
            while len(samples) > 2 and now - samples[1][0] >= self.window:
                samples.popleft()

    def rate(self, command_id: str) -> float | None:
        samples = self.samples.get(command_id)
        if not samples or len(samples) < 2 or samples[-1][0] <= samples[0][0]:
            return None
        (t0, d0), (t1, d1) = samples[0], samples[-1]
        return max(d1 - d0, 0) / (t1 - t0)

    def eta(self, command_id: str, remaining: int) -> float | None:
        rate = self.rate(command_id)
        if remaining <= 0:
            return 0.0
        return remaining / rate if rate else None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    hours, rest = divmod(max(0, round(seconds)), 3600)  # a database clock ahead of this host: 0, not -1:59:55
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _console() -> Console:
    """Piped, as wide as a row needs, whatever COLUMNS says. *Why:* Rich cut cells to 80 columns (`lighthouse-…`, or
    a shell's exported COLUMNS), so a `| grep` of a book id found nothing."""
    return Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)


def _bar(done: int, total: int, width: int = 20, *, ended: bool = False) -> Text:
    filled = round(width * done / total) if total else width
    return Text("━" * filled, style="dim" if ended else "green") + Text("─" * (width - filled), style="dim")


def commands_table(data: Mapping[str, Any], meter: RateMeter | None = None, limit: int = 10) -> Table:
    """One row per command: its bar, counts by state, status, age, and (when watched) rate and ETA. The counts are
    its scenes' states now: an ended command's are greyed, with no rate, as later commands move them. *Why:* a
    completed command read `11/20 ... completed` at 0.25/s while a later one regenerated its scenes."""
    table = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
    for name in ("command", "stage", "progress", "done", "states", "status", "age"):
        table.add_column(name)
    if meter is not None:
        table.add_column("rate")
        table.add_column("eta")
    now = data.get("read_at") or time.time()  # the database's clock when the caller read it (`created_at`'s)
    for c in data["commands"][:limit]:
        p = c["progress"]
        done = p.get("ready", 0) + p.get("failed", 0)
        counts = " ".join(f"{s}={p.get(s, 0)}" for s in STATES if p.get(s))
        if p.get("released"):
            counts += " released=" + ",".join(f"{k}:{v}" for k, v in p.get("released_reasons", {}).items())
        ended = c["status"] in NO_LONGER_ACTIVE
        status = Text(c["status"], style="bold" if c["status"] == "active" else "")
        if c["reason"]:
            status.append(f" {c['reason']}", style="yellow")
        row: list[RenderableType] = [
            c["command_id"][:8],
            Text(c["stage"]),
            _bar(done, p["total"], ended=ended),
            Text(f"{done}/{p['total']}", style="dim" if ended else ""),
            Text(counts, style="dim" if ended else ""),
            status,
            _duration(now - c["created_at"]),
        ]
        if meter is not None:
            rate = None if ended else meter.rate(c["command_id"])
            row.append("-" if rate is None else f"{rate:.2f}/s")
            row.append("done" if ended else _duration(meter.eta(c["command_id"], p["total"] - done)))
        table.add_row(*row)
    if len(data["commands"]) > limit:
        table.add_row(f"(+{len(data['commands']) - limit} older)", *[""] * (len(table.columns) - 1))
    return table


def _cell(state: str | None) -> Text:
    glyph, style = CELLS.get(state or "", MISSING_CELL)
    return Text(glyph, style=style)


def _stage_names(scenes: Sequence[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(stage for s in scenes for stage in s["stages"]))


def _chapters(scenes: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for scene in scenes:
        grouped.setdefault(scene["chapter_id"], []).append(scene)
    return grouped


def _strip(scenes: Sequence[Mapping[str, Any]], stage: str) -> Text:
    text = Text()
    for scene in scenes:
        text.append_text(_cell(scene["stages"].get(stage, {}).get("state")))
    return text


def scene_grid(data: Mapping[str, Any]) -> RenderableType:
    """Every scene's state per stage, one cell each: a row per chapter with a column per stage,
    or, for a book with many chapters, one wrapped strip per stage (chapters split by a space)."""
    scenes = data["scenes"]
    if not scenes:
        return Text("no scenes", style="dim")
    stages = _stage_names(scenes)
    chapters = _chapters(scenes)
    if len(chapters) <= CHAPTER_ROWS_MAX:
        table = Table(box=None, pad_edge=False, header_style="bold")
        table.add_column("chapter", overflow="ellipsis", max_width=24)
        for stage in stages:
            table.add_column(stage, overflow="fold")
        for chapter, members in chapters.items():
            table.add_row(Text(chapter), *[_strip(members, stage) for stage in stages])
        return table
    rows = Table(box=None, pad_edge=False, show_header=False)
    rows.add_column("stage", style="bold")
    rows.add_column("scenes", overflow="fold")
    for stage in stages:
        rows.add_row(stage, Text(" ").join(_strip(members, stage) for members in chapters.values()))
    return rows


def _totals(data: Mapping[str, Any]) -> Text:
    """Per stage, how many scenes are in each state (the grid's legend doubles as its count)."""
    text = Text()
    for stage in _stage_names(data["scenes"]):
        counts = {s: 0 for s in STATES}
        for scene in data["scenes"]:
            state = scene["stages"].get(stage, {}).get("state")
            if state in counts:
                counts[AssetState(state)] += 1
        text.append(f"{stage}: ", style="bold")
        for state in STATES:
            if counts[state]:
                glyph, style = CELLS[state]
                text.append(f"{glyph} {state} {counts[state]}  ", style=style)
        text.rstrip()
        text.append("\n")
    text.rstrip()
    return text


def _failures(data: Mapping[str, Any]) -> list[Text]:
    """Why pairs failed, the first few in reading order: a red cell alone sent the operator to `--json` to find out."""
    failed = [
        (scene, stage, cell.get("error"))
        for scene in data["scenes"]
        for stage, cell in scene["stages"].items()
        if cell.get("state") == AssetState.FAILED
    ]
    if not failed:
        return []
    lines = [Text(f"\nfailed ({len(failed)})", style="bold red")]
    for scene, stage, error in failed[:FAILURES_SHOWN]:
        line = Text(f"{scene['chapter_id']}/{scene['scene_id']} {stage}: ", style="bold")
        line.append(" ".join((error or "(no error recorded)").split()), style="red")
        lines.append(line)
    if len(failed) > FAILURES_SHOWN:
        lines.append(Text(f"(+{len(failed) - FAILURES_SHOWN} more: status --json lists every one)", style="dim"))
    return lines


def status_view(data: BookStatus | Mapping[str, Any], meter: RateMeter | None = None) -> Group:
    """The whole `status` screen: title, commands, the scene grid, its totals and why pairs failed."""
    title = Text(f"book {data['book_id']!r}", style="bold")
    if data["cancelled"]:
        title.append(" (cancelled)", style="bold red")
    n = len(data["scenes"])
    commands: RenderableType = commands_table(data, meter) if data["commands"] else Text("no commands", style="dim")
    scenes = (Text(f"\nscenes ({n})", style="bold"), scene_grid(data), _totals(data))
    return Group(title, commands, *scenes, *_failures(data))


def show_status(
    fetch: Callable[[], Mapping[str, Any]], *, watch: bool, interval: float, console: Console | None = None
) -> None:
    """Print the status once, or, watching, refresh it until every command is terminal (or Ctrl-C)."""
    console = console or _console()
    data = fetch()
    if not watch:
        console.print(status_view(data))
        return
    meter = RateMeter()
    meter.observe(data)
    try:
        with _frames(console, status_view(data, meter)) as show:
            while any(c["status"] not in NO_LONGER_ACTIVE for c in data["commands"]):
                time.sleep(interval)
                try:
                    data = fetch()
                except StoreUnavailable as err:
                    show(Group(status_view(data, meter), _refresh_failed(err)))
                    continue
                meter.observe(data)
                show(status_view(data, meter))
    except KeyboardInterrupt:
        pass


@contextlib.contextmanager
def _frames(console: Console, first: RenderableType) -> Iterator[Callable[[RenderableType], None]]:
    """How a watch shows each refresh: in place in a terminal; piped, a frame printed per refresh. *Why:* piped,
    Live printed only its last frame as it ended, so a watch stopped by SIGTERM (`timeout 5 ... > f`) left nothing."""
    if console.is_terminal:
        with Live(first, console=console, refresh_per_second=4) as live:
            yield live.update
    else:
        console.print(first)
        yield console.print


def _refresh_failed(err: StoreUnavailable) -> Text:
    """A --watch view whose refresh met a store blip keeps the last view, says so, and tries again. *Why:* the
    first refresh after a Postgres restart meets a pooled connection it closed, and the watch ended (exit 3)."""
    return Text(f"{time.strftime('%H:%M:%S')} {err}; retrying", style="bold red")


def show_commands(rows: list[dict[str, Any]], console: Console | None = None) -> None:
    table = Table("command", "book", "stage", "status", "reason", "progress", "age")
    for r in rows:
        p = r["progress"]
        # Ids and reasons as plain text: a str cell is read as Rich markup, and `[/]` in an id crashed the view.
        table.add_row(
            r["command_id"][:8],
            Text(r["book_id"]),
            Text(r["stage"]),
            r["status"],
            Text(r["reason"] or ""),
            _done(p),
            f"{r['age_seconds']:.0f}s",
        )
    (console or _console()).print(table)


def _done(progress: Mapping[str, Any]) -> str:
    """Targets done (ready or failed, as `status` counts them) of the total, the failed named."""
    failed = progress.get(AssetState.FAILED, 0)
    done = f"{progress.get(AssetState.READY, 0) + failed}/{progress['total']}"
    return f"{done} ({failed} failed)" if failed else done


def queues_table(rows: Sequence[QueueRow | Mapping[str, Any]]) -> Table:
    # The deferrals are counted across every book and stage (a count per stage would read every deferred pair):
    # shown once, under the table, rather than as a column that repeated the same figures on every queue.
    totals = rows[0]["deferred"] if rows else {}
    deferred = " ".join(f"{k}={v}" for k, v in totals.items() if v) or "none"
    columns = ("queue", "stage", "consumers", "depth", "in flight", "lane", "books waiting", "breaker")
    table = Table(*columns, caption=f"deferred pairs: {deferred}")
    for r in rows:
        consumers = ", ".join(f"{escape(c['hostname'])} ({c['heartbeat_age_seconds']}s)" for c in r["consumers"])
        awaited = r.get("successor_awaited_seconds")
        if not consumers and awaited is not None:
            consumers = (
                f"[bold yellow]none[/bold yellow] - its worker stopped: a successor is awaited {awaited:g}s more,"
                f" then its commands are BLOCKED; start one: {r['start_worker']}"
            )
        elif not consumers:
            consumers = f"[bold red]none[/bold red] - start one: {r['start_worker']}"
        depth = Text("?", style="bold yellow") if r["depth"] is None else Text(str(r["depth"]))
        breaker = Text(r["breaker"], style="green" if r["breaker"] == "closed" else "bold red")
        row = (str(r["in_flight"]), str(r["lane_limit"]), str(r["books_waiting"]))
        table.add_row(r["queue"], r["stage"], consumers, depth, *row, breaker)
    return table


def show_queues(rows: Sequence[QueueRow | Mapping[str, Any]], console: Console | None = None) -> None:
    (console or _console()).print(queues_table(rows))


def watch_queues(fetch: Callable[[], Sequence[QueueRow]], *, interval: float, console: Console | None = None) -> None:
    """Refresh the queue overview every `interval` seconds until Ctrl-C."""
    console = console or _console()
    try:
        table = queues_table(fetch())
        with _frames(console, table) as show:
            while True:
                time.sleep(interval)
                try:
                    table = queues_table(fetch())
                except StoreUnavailable as err:
                    show(Group(table, _refresh_failed(err)))
                    continue
                show(Group(table, Text(time.strftime("updated %H:%M:%S"), style="dim")))
    except KeyboardInterrupt:
        pass
