"""The HTTP generator: one POST to the stage's inference endpoint per job.

The protocol is in docs/inference-protocol.md. The endpoint configured for the
stage is the only URL ever called: redirects are refused rather than followed, so
a misconfigured or hostile server cannot send the API key or scene text elsewhere.
The API key is never logged and never appears in an error message.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

import requests

from animastor_tasks.errors import ConfigError, GenerationStopped, GeneratorError, redact_url
from animastor_tasks.generators import GenerationRequest, Media, number_param

if TYPE_CHECKING:
    from animastor_tasks.config import Settings
    from animastor_tasks.domain.registry import StageSpec

log = logging.getLogger(__name__)

API_KEY_HEADER = "X-API-Key"
# Params read by this client; they are not sent to the server.
CLIENT_PARAMS = frozenset({"connect_timeout", "read_timeout", "max_bytes"})
# 4xx answers that mean "not now" rather than "never": worth another attempt.
RETRYABLE_4XX = frozenset({408, 429})
_CHUNK = 64 * 1024
_MESSAGE_LIMIT = 300
_ERROR_BODY_LIMIT = 64 * 1024
# Request errors that another attempt cannot fix.
_PERMANENT_REQUEST_ERRORS = (
    requests.exceptions.InvalidURL,
    requests.exceptions.InvalidHeader,
    requests.exceptions.InvalidSchema,
    requests.exceptions.MissingSchema,
)


class HttpGenerator:
    """Calls `spec.endpoint` with the scene input and returns the media in the response body.

    Params: `connect_timeout` (default 3.05 s), `read_timeout` (default 300 s, the
    longest silence allowed between bytes), `max_bytes` (largest accepted body,
    default 512 MiB). Every other param is passed to the server in `params`.
    """

    name: str = "http"

    def __init__(self, spec: StageSpec, settings: Settings) -> None:
        endpoint = spec.endpoint
        if not endpoint:
            raise ConfigError(f"stage {spec.name!r}: generator 'http' needs an endpoint URL")
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"stage {spec.name!r}: endpoint {redact_url(endpoint)!r} is not an http(s) URL")
        self.spec = spec
        self.endpoint = endpoint
        self._shown_endpoint = redact_url(endpoint)
        self._api_key = settings.inference_api_key

    def generate(
        self,
        request: GenerationRequest,
        should_stop: Callable[[], bool],
        progress: Callable[[float], None],
    ) -> Media:
        params: Mapping[str, Any] = {**self.spec.params, **request.params}
        connect_timeout = number_param(params, "connect_timeout", 3.05, minimum=0.001, maximum=600.0)
        read_timeout = number_param(params, "read_timeout", 300.0, minimum=0.001, maximum=86400.0)
        max_bytes = int(number_param(params, "max_bytes", 512 * 1024 * 1024, minimum=1, integer=True))
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

        self._check_stop(should_stop, request)
        progress(0.0)
        log.debug("POST %s stage=%s scene=%s", self._shown_endpoint, request.stage, request.scene_id)
        try:
            with requests.post(
                self.endpoint,
                json=body,
                headers=headers,
                timeout=(connect_timeout, read_timeout),
                allow_redirects=False,
                stream=True,
            ) as response:
                self._check_status(response)
                media_type = self._check_media_type(response)
                data = self._read_body(response, max_bytes, should_stop, request)
        except requests.exceptions.RequestException as err:
            # Connection refused, DNS failure, connect/read timeout, connection reset mid-body.
            raise GeneratorError(
                f"stage {self.spec.name!r}: inference endpoint {self._shown_endpoint} failed: "
                f"{type(err).__name__}: {self._clean(str(err))}",
                retryable=not isinstance(err, _PERMANENT_REQUEST_ERRORS),
            ) from None
        self._check_stop(should_stop, request)
        if not data:
            raise GeneratorError(
                f"stage {self.spec.name!r}: inference endpoint returned an empty body", retryable=False
            )
        progress(1.0)
        return Media(data, media_type)

    def _check_status(self, response: requests.Response) -> None:
        status = response.status_code
        if status == 200:
            return
        if 300 <= status < 400:
            location = response.headers.get("Location", "")
            host = urlsplit(urljoin(self.endpoint, location)).hostname if location else None
            raise GeneratorError(
                f"stage {self.spec.name!r}: inference endpoint answered {status} redirecting to host "
                f"{host or 'unknown'!r}; redirects are refused, configure the final URL as the endpoint",
                retryable=False,
            )
        message = self._server_message(response)
        retryable = status >= 500 or status in RETRYABLE_4XX
        raise GeneratorError(
            f"stage {self.spec.name!r}: inference endpoint answered {status}: {message}", retryable=retryable
        )

    def _check_media_type(self, response: requests.Response) -> str:
        """The body must be the stage's media type; JSON or HTML here means a confused server."""
        got = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
        want = self.spec.media_type.lower()
        if want == "application/octet-stream":
            return got or want
        if got != want:
            raise GeneratorError(
                f"stage {self.spec.name!r}: inference endpoint returned Content-Type {got or 'none'!r}, "
                f"expected {want!r}",
                retryable=False,
            )
        return self.spec.media_type

    def _read_body(
        self,
        response: requests.Response,
        max_bytes: int,
        should_stop: Callable[[], bool],
        request: GenerationRequest,
    ) -> bytes:
        """Read the body in chunks, so a stop is seen during a long download and a huge body is cut off."""
        data = bytearray()
        for chunk in response.iter_content(_CHUNK):
            data += chunk
            if len(data) > max_bytes:
                raise GeneratorError(
                    f"stage {self.spec.name!r}: inference response exceeds max_bytes={max_bytes}", retryable=False
                )
            self._check_stop(should_stop, request)
        return bytes(data)

    def _server_message(self, response: requests.Response) -> str:
        """The server's `{"error": ...}` text, or the start of whatever it sent instead."""
        raw = bytearray()
        try:
            for chunk in response.iter_content(_CHUNK):
                raw += chunk
                if len(raw) >= _ERROR_BODY_LIMIT:
                    break
        except requests.exceptions.RequestException:
            pass  # the status alone still says what happened
        text = raw[:_ERROR_BODY_LIMIT].decode("utf-8", errors="replace")
        try:
            payload = json.loads(text)
        except ValueError:
            payload = None
        if isinstance(payload, dict) and isinstance(payload.get("error"), str):
            text = payload["error"]
        return self._clean(text.strip()) or "(empty body)"

    def _clean(self, message: str) -> str:
        """Shorten a message and make sure the API key cannot leak through it (even if echoed back)."""
        if self._api_key:
            message = message.replace(self._api_key, "***")
        message = redact_url(message)
        return message if len(message) <= _MESSAGE_LIMIT else message[:_MESSAGE_LIMIT] + "..."

    def _check_stop(self, should_stop: Callable[[], bool], request: GenerationRequest) -> None:
        if should_stop():
            raise GenerationStopped(f"generation stopped for scene {request.scene_id} stage {request.stage}")
