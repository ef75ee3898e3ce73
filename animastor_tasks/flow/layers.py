"""Layers: which stages a book generates. Turning one off takes its pairs' authority at once."""

from __future__ import annotations

import logging

from animastor_tasks.domain.book import show_value
from animastor_tasks.domain.gate import layer_enabled, parse_layers
from animastor_tasks.errors import InvalidCommand, StoreUnavailable
from animastor_tasks.flow import gate, validate
from animastor_tasks.ports import Ports

log = logging.getLogger("animastor.commands")


def set_layers(ports: Ports, book_id: object, enable: list[str], disable: list[str]) -> dict[str, bool]:
    """Turn stages on or off for a book; pairs of a disabled stage lose their authority at once."""
    book = validate.known_book(ports, book_id)
    known = ports.settings.registry.names()
    for stage in [*enable, *disable]:
        if stage not in known:
            raise InvalidCommand(f"stage: unknown stage {show_value(stage)} (known: {', '.join(known)})")
    both = sorted(set(enable) & set(disable))
    if both:
        raise InvalidCommand(f"stage: {', '.join(map(show_value, both))} both enabled and disabled; name each once")
    changed = ports.catalog.change_layers(book, {**dict.fromkeys(enable, True), **dict.fromkeys(disable, False)})
    if changed is None:  # removed since it was checked
        raise InvalidCommand(f"book_id: unknown book {show_value(book)}")
    raw, released = changed  # the pending pairs of the stages turned off, released in the change's transaction
    if released:
        log.info("[COMMAND] book=%r layers off: %s; released %d pending pair(s) to dirty", book,
                 ",".join(sorted(set(disable))), len(released))  # fmt: skip
    try:
        ports.deferrals.clear_deferrals(book, released)  # they wait no longer, as a pass's release clears them
        gate.gate_pass(ports, book, dispatch_work=False)
    except StoreUnavailable as err:
        # Saved, the change holds and its pairs are released: every pass and every job's start reads the layers
        # from Postgres. What the pass keeps in Redis (the book's active scenes, its due time) waits for the
        # book's next pass. *Why:* reported as failed, a change in force read as lost.
        log.warning("[COMMAND] book=%r layers saved; its pass not run until its next one: %s", book, err)
    layers = parse_layers(raw)
    return {s: layer_enabled(layers, s) for s in known}


def layers_of(ports: Ports, book_id: object) -> dict[str, bool]:
    book = validate.known_book(ports, book_id)
    parsed = parse_layers(ports.catalog.layers(book))
    return {s: layer_enabled(parsed, s) for s in ports.settings.registry.names()}
