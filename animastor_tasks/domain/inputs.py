"""What a stage's output depends on: the scene's input for the stage and the generator's
fingerprint, hashed so a re-import can tell which ready assets went stale."""

from __future__ import annotations

import hashlib
import json

from animastor_tasks.domain.registry import MediaRegistry, StageSpec

INPUT_HASH_VERSION = "animastor.input.v1"


def input_hash(stage_input: str, fingerprint: str) -> str:
    """sha256 hex of the (input, generator fingerprint) pair.

    Stored next to a ready asset so a re-import can tell whether what produced it
    changed. The pair is encoded as a versioned JSON array with ASCII escapes, so
    no two different pairs share an encoding (no separator ambiguity) and lone
    surrogates cannot make encoding fail.
    """
    if not isinstance(stage_input, str) or not isinstance(fingerprint, str):
        raise TypeError("input_hash takes two strings")
    canonical = json.dumps([INPUT_HASH_VERSION, stage_input, fingerprint], ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def scene_input(spec: StageSpec, text: str, prompt: str) -> str:
    return text if spec.input_field == "text" else prompt


def scene_hashes(registry: MediaRegistry, text: str, prompt: str) -> dict[str, str]:
    return {s.name: input_hash(scene_input(s, text, prompt), s.fingerprint) for s in registry.stages}
