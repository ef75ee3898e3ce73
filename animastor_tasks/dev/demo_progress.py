"""Live progress bars of the demo's commands, one per command: what is ready out of its targets, and why not.

Why rich: the same renderable updates in place on a terminal and prints once, in full, to a log or a pipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.progress import BarColumn, Progress, TextColumn

from animastor_tasks.domain.vocabulary import AssetState

# What is not done yet, shown beside the bar.
_OPEN_STATES = (AssetState.GENERATING, AssetState.PENDING, AssetState.DIRTY, AssetState.FAILED)


def render_progress(rows: Sequence[Any]) -> Group:
    """Bars for command rows (stage, targets, progress counts, status, reason)."""
    progress = Progress(
        TextColumn("{task.fields[stage]:<6}"),
        BarColumn(bar_width=30),
        TextColumn("{task.completed:>3}/{task.total:<3}"),
        TextColumn("{task.fields[counts]}"),
        TextColumn("[bold]{task.fields[status]}[/bold] {task.fields[reason]}"),
    )
    for row in rows:
        p = row.progress
        counts = " ".join(f"{s}={p.get(s, 0)}" for s in _OPEN_STATES if p.get(s))
        progress.add_task(
            row.command_id[:8],
            total=row.targets,
            completed=p.get(AssetState.READY, 0) + p.get(AssetState.FAILED, 0),
            stage=row.stage,
            counts=counts,
            status=row.status,
            reason=row.reason or "",
        )
    return Group(progress)
