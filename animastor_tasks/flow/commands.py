"""The explicit intents: regenerate (the only way work begins), cancel (Stop All), layers.

Every input is validated before anything is written; a bad call raises
`InvalidCommand` naming the field and the value.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import psycopg

from animastor_tasks.domain.book import show_value, validate_id
from animastor_tasks.domain.gate import layer_enabled, parse_layers
from animastor_tasks.errors import InvalidCommand
from animastor_tasks.flow import gate
from animastor_tasks.flow.runtime import Runtime

log = logging.getLogger("animastor.commands")


def _book(rt: Runtime, book_id: object) -> str:
    book = validate_id("book_id", book_id, error=InvalidCommand)
    if not rt.catalog.book_exists(book):
        raise InvalidCommand(f"book_id: unknown book {show_value(book)}")
    return book


def _stages(rt: Runtime, stages: object) -> list[str]:
    if isinstance(stages, str) or not isinstance(stages, list | tuple) or not stages:
        raise InvalidCommand(f"stages: must be a non-empty list of stage names or ['all'], got {show_value(stages)}")
    known = rt.settings.registry.names()
    wanted: list[str] = []
    for i, stage in enumerate(stages):
        if not isinstance(stage, str):
            raise InvalidCommand(f"stages[{i}]: must be a string, got {show_value(stage)}")
        if stage == "all":
            wanted.extend(known)
        elif stage in known:
            wanted.append(stage)
        else:
            raise InvalidCommand(f"stages[{i}]: unknown stage {show_value(stage)} (known: {', '.join(known)}, all)")
    return list(dict.fromkeys(wanted))


def _scene_ids(scenes: object) -> list[tuple[str, str]] | None:
    """The named scenes, validated for shape and id rules (their existence is checked later)."""
    if scenes is None:
        return None
    if isinstance(scenes, str) or not isinstance(scenes, list | tuple) or not scenes:
        raise InvalidCommand(
            f"scenes: must be null or a non-empty list of [chapter_id, scene_id], got {show_value(scenes)}"
        )
    picked: list[tuple[str, str]] = []
    for i, item in enumerate(scenes):
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise InvalidCommand(f"scenes[{i}]: must be [chapter_id, scene_id], got {show_value(item)}")
        chapter = validate_id(f"scenes[{i}][0]", item[0], error=InvalidCommand)
        scene = validate_id(f"scenes[{i}][1]", item[1], error=InvalidCommand)
        picked.append((chapter, scene))
    return list(dict.fromkeys(picked))


def _request_id(command_id: object) -> str:
    if command_id is None:
        return str(uuid.uuid4())
    if not isinstance(command_id, str):
        raise InvalidCommand(f"command_id: must be a UUID string or null, got {show_value(command_id)}")
    try:
        return str(uuid.UUID(command_id))
    except ValueError as err:
        raise InvalidCommand(f"command_id: not a UUID, got {show_value(command_id)}") from err


def _describe(rows: list[Any], targets: dict[str, list[tuple[str, str]]] | None = None) -> list[dict[str, Any]]:
    return [
        {
            "command_id": row.command_id,
            "stage": row.stage,
            "targets": [list(t) for t in targets[row.stage]] if targets else row.targets,
            "status": row.status,
        }
        for row in rows
    ]


def regenerate(
    rt: Runtime,
    book_id: object,
    stages: object,
    scenes: object = None,
    command_id: object = None,
    force: object = True,
) -> dict[str, Any]:
    """Create one command per stage for the named scenes and start a gate pass at once."""
    if not isinstance(force, bool):
        raise InvalidCommand(f"force: must be true or false, got {show_value(force)}")
    request_id = _request_id(command_id)
    book = validate_id("book_id", book_id, error=InvalidCommand)
    wanted = _stages(rt, stages)
    named = _scene_ids(scenes)
    # Every check that needs the store, in one transaction.
    context = rt.catalog.command_context(book, named, request_id)
    if not context.exists:
        raise InvalidCommand(f"book_id: unknown book {show_value(book)}")
    if context.replay_of:
        return _replay(book, request_id, rt.ledger.commands(command_ids=context.replay_of))
    if named is not None:
        missing = [i for i, pair in enumerate(named) if pair not in context.scenes]
        if missing:
            i = missing[0]
            raise InvalidCommand(f"scenes[{i}]: scene {show_value(list(named[i]))} is not in book {show_value(book)}")
    targets = named if named is not None else context.scenes

    layers = parse_layers(context.layers_raw)
    skipped = [{"stage": s, "reason": "layer_disabled"} for s in wanted if not layer_enabled(layers, s)]
    enabled = [s for s in wanted if layer_enabled(layers, s)]
    if not enabled:
        return {"commands": [], "skipped": skipped}

    per_stage = {
        stage: (request_id if len(enabled) == 1 else str(uuid.uuid5(uuid.UUID(request_id), stage)), targets)
        for stage in enabled
    }
    # A new explicit intent lifts the cancel; Redis first, so a Redis outage writes nothing.
    rt.coord.clear_cancel_flag(book)
    try:
        rt.ledger.create_commands(book, request_id, per_stage, force)
    except psycopg.errors.UniqueViolation:
        return _replay(book, request_id, rt.ledger.commands_for_request(request_id))
    pairs = [(c, s, stage) for stage in enabled for c, s in targets]
    rt.coord.start_work(book, pairs, targets, force_ttl=rt.settings.force_ttl_seconds if force else None)
    log.info(
        "[COMMAND] book=%r regenerate stages=%s scenes=%d request=%s skipped=%s",
        book,
        ",".join(enabled),
        len(targets),
        request_id,
        ",".join(s["stage"] for s in skipped) or "none",
    )
    gate.gate_pass(rt, book)
    rows = rt.ledger.commands(book=book, command_ids=[cid for cid, _ in per_stage.values()])
    return {"commands": _describe(rows, {s: t for s, (_, t) in per_stage.items()}), "skipped": skipped}


def _replay(book: str, request_id: str, rows: list[Any]) -> dict[str, Any]:
    if rows and rows[0].book_id != book:
        raise InvalidCommand(f"command_id: {request_id} was already used for another book")
    return {"commands": _describe(rows), "skipped": [], "replayed": True}


def cancel(rt: Runtime, book_id: object, reason: object = None) -> dict[str, Any]:
    """Stop All: after this returns no job of the book may start GPU work until a new regenerate."""
    if reason is not None and not isinstance(reason, str):
        raise InvalidCommand(f"reason: must be a string or null, got {show_value(reason)}")
    book = _book(rt, book_id)
    # The flag goes first: from this moment running jobs see should_stop() and the gate denies.
    rt.coord.stop_book(book)
    cancelled, released, dispatched = rt.ledger.cancel_book(book, reason)
    rt.coord.drop_leases([(book, *pair) for pair, _ in dispatched])
    dispatch_ids = [d for _, d in dispatched]
    if dispatch_ids and rt.publisher is not None:
        rt.publisher.revoke(dispatch_ids)
    log.info(
        "[COMMAND] book=%r cancelled commands=%d released=%d revoked=%d reason=%r",
        book,
        len(cancelled),
        released,
        len(dispatch_ids),
        reason,
    )
    return {"book_id": book, "cancelled_commands": cancelled, "released": released, "revoked": len(dispatch_ids)}


def set_layers(rt: Runtime, book_id: object, enable: list[str], disable: list[str]) -> dict[str, bool]:
    """Turn stages on or off for a book; pairs of a disabled stage lose their authority at once."""
    book = _book(rt, book_id)
    known = rt.settings.registry.names()
    for stage in [*enable, *disable]:
        if stage not in known:
            raise InvalidCommand(f"stage: unknown stage {show_value(stage)} (known: {', '.join(known)})")
    layers = {f"{s}_enabled": layer_enabled(parse_layers(rt.catalog.layers(book)), s) for s in known}
    layers.update({f"{s}_enabled": True for s in enable})
    layers.update({f"{s}_enabled": False for s in disable})
    raw = json.dumps(layers, sort_keys=True)
    rt.catalog.set_layers(book, raw)
    rt.coord.mirror_layers(book, raw)
    gate.gate_pass(rt, book, dispatch_work=False)
    return {s: layers[f"{s}_enabled"] for s in known}


def layers_of(rt: Runtime, book_id: object) -> dict[str, bool]:
    book = _book(rt, book_id)
    parsed = parse_layers(rt.catalog.layers(book))
    return {s: layer_enabled(parsed, s) for s in rt.settings.registry.names()}


def status(rt: Runtime, book_id: object) -> dict[str, Any]:
    book = _book(rt, book_id)
    commands = rt.ledger.commands(book=book)
    scenes: dict[tuple[str, str], dict[str, Any]] = {}
    for chapter, scene, stage, state, artifact in rt.ledger.scene_states(book):
        entry = scenes.setdefault((chapter, scene), {"chapter_id": chapter, "scene_id": scene, "stages": {}})
        entry["stages"][stage] = {"state": state, "artifact": artifact}
    cancelled = rt.ledger.is_tombstoned(book) or rt.coord.cancel_flag_set(book)
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
                "progress": {"total": c.targets, **c.progress},
            }
            for c in commands
        ],
        "scenes": list(scenes.values()),
    }
