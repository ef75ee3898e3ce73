"""The `openai-images` generator: a scene's prompt drawn by an OpenAI-compatible image server.

`POST {endpoint}/images/generations` with `model`, `prompt`, `n: 1`, `size` and
`response_format: b64_json`; the image comes back base64-encoded inside the JSON. The
`url` response format is refused: fetching the image from a second, server-chosen URL
would break the rule that the configured endpoint is the only URL ever called.
"""

from __future__ import annotations

import binascii
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import requests

from animastor_tasks.domain.media_types import JPEG_TYPES, base_type
from animastor_tasks.errors import GeneratorError
from animastor_tasks.generators import GenerationRequest, Media
from animastor_tasks.generators.media import PNG_SIGNATURE, CutShort, check_known_media
from animastor_tasks.generators.openai_common import OCTET_STREAM, OpenAIGenerator, media_type_of, string_param
from animastor_tasks.generators.server_words import json_error

SIZE_PATTERN = re.compile(r"[1-9][0-9]{0,4}x[1-9][0-9]{0,4}|auto")
_MAGIC: tuple[tuple[str, Callable[[bytes], bool]], ...] = (
    ("image/png", lambda b: b.startswith(PNG_SIGNATURE)),
    ("image/jpeg", lambda b: b.startswith(b"\xff\xd8\xff")),
    ("image/webp", lambda b: b[:4] == b"RIFF" and b[8:12] == b"WEBP"),
)


class OpenAIImagesGenerator(OpenAIGenerator):
    """Calls `/images/generations` under `spec.endpoint` and returns the one image it answers.

    Params: `model` (required), `size` (`WIDTHxHEIGHT` or `auto`; not sent when unset, so
    the server's default applies), `response_format` (only `b64_json`), the transport's
    `connect_timeout`, `read_timeout`, `max_bytes`, `retries` (2), `max_retry_after`
    (30 s). Other params (`quality`, `style`, ...) are sent as body fields. The image
    must be of the stage's media type (checked by its magic bytes; a PNG fully).
    """

    name = "openai-images"
    route = "/images/generations"
    own_fields = frozenset({"model", "prompt", "n", "size", "response_format"})

    def generate(
        self,
        request: GenerationRequest,
        should_stop: Callable[[], bool],
        progress: Callable[[float], None],
    ) -> Media:
        params = self._params(request)
        body = {**self._extra_fields(params), **self._fields(params), "prompt": request.input}
        # The body handed on, not kept here: `_decode` lets it go once parsed (an answer of 500 MB peaked at 2.4 GB).
        media = self._decode(self._post(body, "application/json", params, request, should_stop, progress,
                                        self._check_type)[1])  # fmt: skip
        progress(1.0)
        return media

    def _fields(self, params: Mapping[str, Any]) -> dict[str, Any]:
        fields: dict[str, Any] = {"model": string_param(params, "model", None), "n": 1}
        string_param(params, "response_format", "b64_json", choices=("b64_json",))
        if "size" in params:
            fields["size"] = string_param(params, "size", None, pattern=SIZE_PATTERN)
        return {**fields, "response_format": "b64_json"}

    def _check_type(self, response: requests.Response) -> str:
        got = media_type_of(response)
        if got != "application/json":
            raise self._fail(
                f"returned Content-Type {got or 'none'!r}, expected 'application/json'", misconfigured=True
            )
        return got

    def _decode(self, raw: bytes) -> Media:
        """The image inside `{"data": [{"b64_json": ...}]}`, checked against the stage's media type."""
        try:
            payload = json.loads(raw)
        except RecursionError:  # nested past the parser's depth: no answer of the shape asked for
            raise self._fail("answered JSON nested too deep to read", misconfigured=True) from None
        except ValueError as err:
            if _cut_short(err):  # a body without a length whose connection dropped: not the server's setup
                raise self._fail(f"answered JSON cut short ({err})", retryable=True) from None
            raise self._fail("answered a body that is not JSON", misconfigured=True) from None
        del raw  # parsed: the body, its JSON and its image are not all held at once
        said = json_error(payload)
        if said:  # an error under 200 (a model still loading): the server's words, and worth another attempt
            said = self._transport.clean(said)
            raise GeneratorError(f"stage {self.spec.name!r}: inference endpoint answered 200 with an error: {said}")
        try:
            encoded = payload["data"][0]["b64_json"]
            if not isinstance(encoded, str):
                raise TypeError("b64_json is not a string")
        except (LookupError, TypeError) as err:
            # Its answer to every scene (a URL where the base64 image was asked for): the server is not set up so.
            raise self._fail(
                f"answered JSON without an image in data[0].b64_json ({type(err).__name__}); it must honour"
                " response_format b64_json",
                misconfigured=True,
            ) from None
        try:
            data = decode_base64(encoded)
        except (ValueError, binascii.Error) as err:
            raise self._fail(f"answered a data[0].b64_json that is not base64 ({err})", misconfigured=True) from None
        if not data:
            raise self._fail("answered an empty image", retryable=True)  # its answer to whatever it is sent
        found = next((kind for kind, test in _MAGIC if test(data)), OCTET_STREAM)
        want = base_type(self.spec.media_type)
        named = "image/jpeg" if want in JPEG_TYPES else want  # a stage of `image/jpg` stores JPEGs too
        if want != OCTET_STREAM and found != named:  # the model's output type, whatever the scene
            raise self._fail(
                f"returned an image of type {found!r}, stage {self.spec.name!r} stores {want!r}", misconfigured=True
            )
        try:
            check_known_media(found, data)
        except ValueError as err:
            raise self._fail(f"returned a broken image ({err})", retryable=isinstance(err, CutShort)) from None
        return Media(data, self.spec.media_type if want != OCTET_STREAM else found)


def _cut_short(err: ValueError) -> bool:
    """Whether JSON failed to parse only because it stops: inside a string, or where more was due at its end."""
    if not isinstance(err, json.JSONDecodeError):
        return False
    return err.msg.startswith("Unterminated string") or err.pos >= len(err.doc.rstrip())


_URLSAFE = str.maketrans("-_", "+/")


def decode_base64(text: str) -> bytes:
    """The bytes of a base64 image as servers write it: wrapped in lines (Python's `encodebytes`), as a `data:` URL,
    in the URL-safe alphabet, without its padding. *Why:* each was refused as a server not set up for b64_json,
    and the lane's breaker opened on a server that sent its images. Copied only where it must be rewritten, and
    decoded from the text as it is: an image of 500 MB took 2.75 times its size again to decode."""
    if text.startswith("data:"):
        text = text.partition(",")[2]
    text = "".join(text.split())  # the text itself when it has no line breaks
    if "-" in text or "_" in text:
        text = text.translate(_URLSAFE)
    if len(text) % 4 or text.endswith("==="):  # its padding left out, or more of it than any length takes
        text = text.rstrip("=")
        text += "=" * (-len(text) % 4)
    return binascii.a2b_base64(text, strict_mode=True)
