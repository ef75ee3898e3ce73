"""Every input of an explicit intent, checked before anything is written.

A bad value raises `InvalidCommand` naming the field and showing the value.
"""

from __future__ import annotations

import re
import unicodedata
import uuid

from animastor_tasks.domain.book import check_storable, show_value, validate_id
from animastor_tasks.domain.vocabulary import Priority
from animastor_tasks.errors import InvalidCommand
from animastor_tasks.ports import Ports

_CANONICAL_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def book_id(value: object) -> str:
    """A well-formed book id (its book not looked up)."""
    return validate_id("book_id", value, error=InvalidCommand)


def known_book(ports: Ports, value: object) -> str:
    book = book_id(value)
    if not ports.catalog.book_exists(book):
        raise InvalidCommand(f"book_id: unknown book {show_value(book)}")
    return book


def stage_names(ports: Ports, stages: object) -> list[str]:
    if isinstance(stages, str) or not isinstance(stages, list | tuple) or not stages:
        raise InvalidCommand(f"stages: must be a non-empty list of stage names or ['all'], got {show_value(stages)}")
    known = ports.settings.registry.names()
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


def scene_ids(scenes: object) -> list[tuple[str, str]] | None:
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


def request_id(command_id: object) -> str:
    """The caller's UUID in its canonical 8-4-4-4-12 form (the contract's schema), lower-cased as Postgres answers
    it. Braces, `urn:uuid:` or hyphens elsewhere were read as the same UUID and answered as another string."""
    if command_id is None:
        return str(uuid.uuid4())
    if not isinstance(command_id, str):
        raise InvalidCommand(f"command_id: must be a UUID string or null, got {show_value(command_id)}")
    if not _CANONICAL_UUID.fullmatch(command_id):
        raise InvalidCommand(
            f"command_id: not a UUID in its canonical form (8-4-4-4-12 hex digits), got {show_value(command_id)}"
        )
    return command_id.lower()


def lane(ports: Ports, queue: object) -> str | None:
    """A GPU queue named by a caller (a gate pass of one lane): None, or a stage's queue."""
    known = ports.settings.registry.queues()
    if queue is not None and (not isinstance(queue, str) or queue not in known):
        raise InvalidCommand(f"lane: must be null or one of {', '.join(known)}, got {show_value(queue)}")
    return queue


def priority(value: object) -> Priority:
    if value is None:
        return Priority.NORMAL
    if not isinstance(value, str) or value not in set(Priority):
        known = ", ".join(Priority)
        raise InvalidCommand(f"priority: must be one of {known} (or null), got {show_value(value)}")
    return Priority(value)


MAX_REASON_CHARS = 1_000
# What a reason may not hold, as an id may not: controls (Cc: C0, DEL, C1), line and paragraph separators, bidi
# controls and BOM. *Why:* `commands` and `status` print it on an operator's terminal, which runs its escapes.
_NOT_IN_REASON = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def reason(value: object) -> str | None:
    """A cancel's free-text reason, checked before Stop All writes anything: one Postgres cannot store failed
    the cancel after the flag was set, with no tombstone and the commands left active."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidCommand(f"reason: must be a string or null, got {show_value(value)}")
    check_storable("reason", value, error=InvalidCommand)
    found = _NOT_IN_REASON.search(value)
    if found is not None:
        ch = found.group()
        name = unicodedata.name(ch, f"(category {unicodedata.category(ch)})")
        raise InvalidCommand(f"reason: must not contain U+{ord(ch):04X} {name} at index {found.start()}")
    if len(value) > MAX_REASON_CHARS:  # copied onto each command it ends, and shown in every status
        raise InvalidCommand(f"reason: must be at most {MAX_REASON_CHARS} characters (has {len(value)})")
    return value


#: How far from the runtime's clock a command's send stamp may lie and still be believed: a regenerate waits in the
#: control queue behind others for seconds or minutes, never a day; ahead, the broker's clock and Redis's agree closely.
STAMP_PAST_SECONDS = 86_400.0
STAMP_AHEAD_SECONDS = 60.0


def sent_at(stamp: float | None, now: float) -> float | None:
    """A command's send stamp (`registry.SENT_AT_HEADER`) if it can be believed, else None (taken as unstamped). *Why:*
    one in milliseconds, or a year ahead, voided every later regenerate of its book for good."""
    if stamp is None or not now - STAMP_PAST_SECONDS <= stamp <= now + STAMP_AHEAD_SECONDS:
        return None
    return stamp
