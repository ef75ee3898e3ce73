"""What the CLI shows people: progress bars, tables, the queue overview."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from animastor_tasks.domain.vocabulary import NO_LONGER_ACTIVE, AssetState
from animastor_tasks.worker.wiring import Wiring

# Progress columns, most finished first.
STATES = (AssetState.READY, AssetState.GENERATING, AssetState.PENDING, AssetState.DIRTY, AssetState.FAILED)


def _status_renderable(data: dict[str, Any]) -> Group:
    progress = Progress(
        TextColumn("{task.fields[stage]:<8}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[counts]}"),
        TextColumn("[bold]{task.fields[status]}[/bold] {task.fields[reason]}"),
        TextColumn("{task.fields[age]}"),
    )
    now = time.time()
    for c in data["commands"][:10]:
        p = c["progress"]
        counts = " ".join(f"{s}={p.get(s, 0)}" for s in STATES if p.get(s))
        progress.add_task(
            c["command_id"][:8],
            total=p["total"],
            completed=p.get("ready", 0) + p.get("failed", 0),
            stage=c["stage"],
            counts=counts,
            status=c["status"],
            reason=c["reason"] or "",
            age=f"{now - c['created_at']:.0f}s",
        )
    title = f"book {data['book_id']!r}" + (" [red](cancelled)[/red]" if data["cancelled"] else "")
    return Group(title, progress)


def show_status(fetch: Callable[[], dict[str, Any]], *, watch: bool, interval: float) -> None:
    console = Console()
    data = fetch()
    if not watch:
        console.print(_status_renderable(data))
        return
    with Live(_status_renderable(data), console=console, refresh_per_second=4) as live:
        while any(c["status"] not in NO_LONGER_ACTIVE for c in data["commands"]):
            time.sleep(interval)
            data = fetch()
            live.update(_status_renderable(data))


def show_commands(rows: list[dict[str, Any]]) -> None:
    table = Table("command", "book", "stage", "status", "reason", "progress", "age")
    for r in rows:
        p = r["progress"]
        table.add_row(
            r["command_id"][:8],
            r["book_id"],
            r["stage"],
            r["status"],
            r["reason"] or "",
            f"{p.get(AssetState.READY, 0)}/{p['total']}",
            f"{r['age_seconds']:.0f}s",
        )
    Console().print(table)


def queue_overview(rt: Wiring) -> list[dict[str, Any]]:
    specs = rt.settings.stages
    now = time.time()
    live = rt.presence.live_consumers([s.queue for s in specs], now)
    amqp = rt.presence.counts([s.queue for s in specs]) if rt.presence.amqp_url else {}
    running = rt.reads.lane_usage()
    depth = _queue_depths(rt, [s.queue for s in specs])
    deferred = rt.deferrals.deferral_counts(rt.ports.book_state.active_books(), now)
    return [
        {
            "queue": spec.queue,
            "stage": spec.name,
            "consumers": [
                {"hostname": host, "heartbeat_age_seconds": round(rt.settings.presence_ttl_seconds - (exp - now), 1)}
                for host, exp in sorted(live.get(spec.queue, {}).items())
            ],
            "broker_consumers": amqp.get(spec.queue),
            "depth": depth.get(spec.queue),
            "in_flight": running.get(spec.name, 0),
            "lane_limit": spec.lane_limit,
            "breaker": rt.breaker.breaker_state(spec.queue),
            "deferred": deferred,
            "start_worker": f"animastor-tasks worker --stage {spec.name}",
        }
        for spec in specs
    ]


def _queue_depths(rt: Wiring, queues: list[str]) -> dict[str, int | None]:
    """Messages waiting in each queue, asked of the broker (None when it cannot say)."""
    from kombu import Connection

    depths: dict[str, int | None] = {}
    try:
        with Connection(rt.settings.broker_url, connect_timeout=3) as conn:
            for queue in queues:
                channel = conn.channel()
                try:
                    depths[queue] = int(channel.queue_declare(queue=queue, passive=True).message_count)
                except Exception:
                    depths[queue] = 0
                finally:
                    channel.close()
    except Exception:
        return dict.fromkeys(queues)
    return depths


def show_queues(rows: list[dict[str, Any]]) -> None:
    table = Table("queue", "stage", "consumers", "depth", "in flight", "lane", "breaker", "deferred")
    for r in rows:
        consumers = ", ".join(f"{c['hostname']} ({c['heartbeat_age_seconds']}s)" for c in r["consumers"])
        if not consumers:
            consumers = f"[bold red]none[/bold red] - start one: {r['start_worker']}"
        deferred = " ".join(f"{k}={v}" for k, v in r["deferred"].items() if v) or "-"
        table.add_row(
            r["queue"],
            r["stage"],
            consumers,
            str(r["depth"] if r["depth"] is not None else "?"),
            str(r["in_flight"]),
            str(r["lane_limit"]),
            r["breaker"],
            deferred,
        )
    Console().print(table)
