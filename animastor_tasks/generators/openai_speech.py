"""The `openai-speech` generator: a scene's text read aloud by an OpenAI-compatible TTS server.

`POST {endpoint}/audio/speech` with `model`, `input`, `voice` and `response_format`; the
answer is the audio bytes. Useful because many self-hosted speech servers expose exactly
this route, so they need no adapter of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import requests

from animastor_tasks.domain.media_types import OGG_TYPES, base_type
from animastor_tasks.errors import GeneratorError
from animastor_tasks.generators import GenerationRequest, Media
from animastor_tasks.generators.media import CutShort, NotMedia, check_known_media
from animastor_tasks.generators.openai_common import OCTET_STREAM, OpenAIGenerator, media_type_of, string_param

# response_format -> the media type stored for it.
FORMATS: dict[str, str] = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "pcm": "audio/pcm",
}
# How an error names the format a body failed to be (PCM is not checked: see `check_known_media`).
_NAMES = {
    "wav": "a WAV file",
    "mp3": "an MP3 file",
    "flac": "a FLAC file",
    "opus": "an Ogg Opus file",
    "aac": "an ADTS AAC file",
}
# Other names servers give the same types.
_ALIASES = {
    "audio/x-wav": "audio/wav",
    "audio/wave": "audio/wav",
    "audio/vnd.wave": "audio/wav",
    "audio/mp3": "audio/mpeg",
}


class OpenAISpeechGenerator(OpenAIGenerator):
    """Calls `/audio/speech` under `spec.endpoint` and returns the audio it answers.

    Params: `model` (required), `voice` (default `alloy`), `response_format` (default: the
    one matching the stage's media type, `wav` for `audio/wav`; it must match that type),
    the transport's `connect_timeout`, `read_timeout`, `max_bytes`, `retries` (2),
    `max_retry_after` (30 s). Other params (`speed`, `instructions`, ...) are sent as
    body fields.
    """

    name = "openai-speech"
    route = "/audio/speech"
    own_fields = frozenset({"model", "input", "voice", "response_format"})

    def generate(
        self,
        request: GenerationRequest,
        should_stop: Callable[[], bool],
        progress: Callable[[float], None],
    ) -> Media:
        params = self._params(request)
        fields = self._fields(params)
        response_format, media_type = self._response_format(params)
        body = {**self._extra_fields(params), **fields, "input": request.input}
        _, data = self._post(
            body, f"{media_type}, application/json", params, request, should_stop, progress, self._check_type
        )
        try:  # as the format asked for, the one stored: a WAV answered for mp3 is not an MP3 either
            check_known_media(FORMATS[response_format], data)
        except ValueError as err:
            what = _NAMES.get(response_format, FORMATS[response_format])
            other = _other_format(data, FORMATS[response_format])
            if other is not None:  # a server that ignores response_format answers every scene so
                raise self._fail(
                    f"returned {other} audio, not {what}: it must honour response_format {response_format!r}",
                    misconfigured=True,
                ) from None
            raise self._fail(
                f"returned audio that is not {what} ({err})", retryable=isinstance(err, CutShort | NotMedia)
            ) from None
        progress(1.0)
        return Media(data, media_type)

    def _fields(self, params: Mapping[str, Any]) -> dict[str, Any]:
        model, voice = string_param(params, "model", None), string_param(params, "voice", "alloy")
        return {"model": model, "voice": voice, "response_format": self._response_format(params)[0]}

    def _response_format(self, params: Mapping[str, Any]) -> tuple[str, str]:
        """(response_format, media type stored); the format must give the stage's media type."""
        stage_type = _ALIASES.get(base_type(self.spec.media_type), base_type(self.spec.media_type))
        default = next((fmt for fmt, kind in FORMATS.items() if kind == stage_type), "wav")
        fmt = string_param(params, "response_format", default, choices=FORMATS)
        if stage_type != OCTET_STREAM and FORMATS[fmt] != stage_type:
            raise GeneratorError(
                f"param 'response_format' {fmt!r} gives {FORMATS[fmt]} but stage {self.spec.name!r} "
                f"stores {self.spec.media_type}",
                misconfigured=True,
            )
        return fmt, self.spec.media_type if stage_type != OCTET_STREAM else FORMATS[fmt]

    def _check_type(self, response: requests.Response) -> str:
        """Any audio type (servers name WAV four ways, and Ogg `application/ogg` too) or a bare byte stream; JSON or
        HTML is a confused server, or one that answered its error under 200."""
        got = media_type_of(response)
        if got == "application/json":
            raise self._transport.json_instead(response, "audio")
        if got and not got.startswith("audio/") and got not in (OCTET_STREAM, *OGG_TYPES):
            raise self._fail(f"returned Content-Type {got!r}, expected audio", misconfigured=True)
        return got


def _other_format(data: bytes, asked: str) -> str | None:
    """The checked format other than `asked` that `data` is whole in, if any (PCM is not checked)."""
    for kind in (k for k in _NAMES if FORMATS[k] != asked):
        try:
            check_known_media(FORMATS[kind], data)
        except ValueError:
            continue
        return FORMATS[kind]
    return None
