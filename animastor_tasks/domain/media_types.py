"""The media types the runtime reads by their usual names (a generator's output is checked by them, an artifact is
named by them), and a type as they are compared: without parameters, lower-cased."""

from __future__ import annotations

WAV_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})
MP3_TYPES = frozenset({"audio/mpeg", "audio/mp3", "audio/mpeg3", "audio/x-mpeg"})
AAC_TYPES = frozenset({"audio/aac", "audio/aacp", "audio/x-aac"})
OGG_TYPES = frozenset({"audio/ogg", "audio/opus", "application/ogg"})
FLAC_TYPES = frozenset({"audio/flac", "audio/x-flac"})
JPEG_TYPES = frozenset({"image/jpeg", "image/jpg"})


def base_type(media_type: str) -> str:
    """`Audio/WAV; codecs=1` -> `audio/wav`."""
    return media_type.split(";")[0].strip().lower()
