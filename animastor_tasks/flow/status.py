"""A book's status as the operator's `status` command and `status --json` show it."""

from __future__ import annotations

import logging
from typing import Any

from animastor_tasks.errors import StoreUnavailable
from animastor_tasks.flow import validate
from animastor_tasks.ports import CommandRow, Ports

log = logging.getLogger("animastor.status")


def progress(row: CommandRow) -> dict[str, Any]:
    """A command's progress: `total`, its targets by their pair's state now, and `released` (how many
    targets were released to dirty while it was active) with `released_reasons` ({reason: count}). A
    released target is also counted under its pair's state, so `released` overlaps those counts."""
    return {
        "total": row.targets,
        **row.progress,
        "released": sum(row.released.values()),
        "released_reasons": dict(sorted(row.released.items())),
    }


def status(ports: Ports, book_id: object) -> dict[str, Any]:
    book = validate.known_book(ports, book_id)
    # Every command still at work, however many newer ones ended since: 200 readers' scenes hid a bulk command.
    commands = ports.commands.commands(book=book, every_active=True)
    scenes: dict[tuple[str, str], dict[str, Any]] = {}
    uris, errors = ports.assets.artifact_uris(book), ports.assets.pair_errors(book)
    for chapter, scene, stage, state, artifact in ports.assets.scene_states(book):
        entry = scenes.setdefault((chapter, scene), {"chapter_id": chapter, "scene_id": scene, "stages": {}})
        pair = (chapter, scene, stage)
        entry["stages"][stage] = {
            "state": state,
            "artifact": artifact,
            "artifact_uri": uris.get(pair),
            "error": errors.get(pair),  # *why:* a failed cell said nothing of why; it was in Postgres and a log
        }
    cancelled = ports.commands.is_tombstoned(book) or _cancel_flag(ports, book)
    return {
        "book_id": book,
        "cancelled": cancelled,
        "commands": [
            {
                "command_id": c.command_id,
                "stage": c.stage,
                "status": c.status,
                "reason": c.reason,
                "created_at": c.created_at,
                "progress": progress(c),
            }
            for c in commands
        ],
        "scenes": list(scenes.values()),
    }


def _cancel_flag(ports: Ports, book: str) -> bool:
    """The book's cancel flag, or False when Redis does not answer: everything else shown is Postgres's, and a Stop
    All that went through has its Postgres tombstone. *Why:* during a Redis outage `status` exited 3, and the
    operator could not see a book's progress at all while restoring it."""
    try:
        return ports.book_state.cancel_flag_set(book)
    except StoreUnavailable as err:
        log.warning("[STATUS] book=%r: cancel flag unread (%s); shown from the Postgres tombstone alone", book, err)
        return False
