"""The HTTP generator: one POST to the stage's inference endpoint per job.

The protocol is in docs/inference-protocol.md. The endpoint configured for the
stage is the only URL ever called: redirects are refused rather than followed, so
a misconfigured or hostile server cannot send the API key or scene text elsewhere.
The API key is never logged and never appears in an error message. The HTTP
behaviour itself (timeouts, status codes, body limits) is `generators.transport`'s,
shared with the OpenAI-compatible generators.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import requests

from animastor_tasks.domain.media_types import base_type
from animastor_tasks.errors import GeneratorError
from animastor_tasks.generators import GenerationRequest, Media
from animastor_tasks.generators.media import CutShort, NotMedia, check_known_media
from animastor_tasks.generators.transport import (
    ERROR_PAGE_TYPES,
    LIMIT_PARAMS,
    RETRYABLE_4XX,
    Limits,
    Transport,
    check_endpoint,
)

if TYPE_CHECKING:
    from animastor_tasks.config import Settings
    from animastor_tasks.domain.registry import StageSpec

log = logging.getLogger(__name__)

API_KEY_HEADER = "X-API-Key"
# Params read by this client; they are not sent to the server.
CLIENT_PARAMS = LIMIT_PARAMS
__all__ = ["API_KEY_HEADER", "CLIENT_PARAMS", "RETRYABLE_4XX", "HttpGenerator"]


class HttpGenerator:
    """Calls `spec.endpoint` with the scene input and returns the media in the response body.

    Params: `connect_timeout` (default 3.05 s), `read_timeout` (default 300 s, the
    longest silence allowed between bytes), `total_timeout` (default twice `read_timeout`,
    the whole answer), `max_bytes` (largest accepted body, default 512 MiB). Every other
    param is passed to the server in `params`. A WAV or PNG body must parse as one.
    """

    name: str = "http"

    def __init__(self, spec: StageSpec, settings: Settings) -> None:
        self.spec = spec
        self.endpoint = check_endpoint(spec.name, self.name, spec.endpoint)
        Limits.from_params(spec.params)  # a bad limit stops the worker's start, not each job
        self._api_key = settings.inference_api_key
        self._transport = Transport(spec.name, self.endpoint, self._api_key)

    def generate(
        self,
        request: GenerationRequest,
        should_stop: Callable[[], bool],
        progress: Callable[[float], None],
    ) -> Media:
        params: Mapping[str, Any] = {**self.spec.params, **request.params}
        limits = Limits.from_params(params)
        body = {
            "stage": request.stage,
            "book_id": request.book_id,
            "chapter_id": request.chapter_id,
            "scene_id": request.scene_id,
            "input": request.input,
            "params": {k: v for k, v in params.items() if k not in CLIENT_PARAMS},
        }
        headers = {"Accept": f"{self.spec.media_type}, application/json"}
        if self._api_key:
            headers[API_KEY_HEADER] = self._api_key

        self._transport.check_stop(should_stop, request)
        progress(0.0)
        log.debug("POST %s stage=%s scene=%s", self._transport.shown_url, request.stage, request.scene_id)
        media_type, data = self._transport.post(body, headers, limits, request, should_stop, self._check_media_type)
        try:
            check_known_media(media_type, data)
        except ValueError as err:  # cut short or no such file at all (an error text): not the scene's; else it is
            raise GeneratorError(
                f"stage {self.spec.name!r}: inference endpoint returned a body that is not {media_type} ({err})",
                retryable=isinstance(err, CutShort | NotMedia),
            ) from None
        progress(1.0)
        return Media(data, media_type)

    def _check_media_type(self, response: requests.Response) -> str:
        """The body must be the stage's media type (any but a server's error page, for a stage of bytes): JSON or
        HTML here means a confused server, or one that answered its error under 200."""
        got = base_type(response.headers.get("Content-Type", ""))
        want = base_type(self.spec.media_type)  # its parameters, if any, are the stage's to store
        if got == "application/json" and want != got:
            raise self._transport.json_instead(response, repr(want))
        if want == "application/octet-stream" and got not in ERROR_PAGE_TYPES:
            return got or want
        if got != want:
            raise GeneratorError(
                f"stage {self.spec.name!r}: inference endpoint returned Content-Type {got or 'none'!r}, "
                f"expected {want!r}",
                misconfigured=True,
            )
        return self.spec.media_type
