"""What the OpenAI-compatible generators share: the route under the endpoint, the Bearer key, params.

Many self-hosted GPU servers speak the OpenAI API shape, so one stage config (an
endpoint and a few params) reaches them without a server-side adapter. The HTTP
behaviour is `generators.transport`'s, the same as the `http` generator's.

The key is `ANIMASTOR_INFERENCE_API_KEY`, deliberately not `OPENAI_API_KEY`: a real
OpenAI key lying in a developer's environment must never be sent to whichever
self-hosted endpoint a stage names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import requests

from animastor_tasks.domain.media_types import base_type
from animastor_tasks.errors import GeneratorError
from animastor_tasks.generators import GenerationRequest
from animastor_tasks.generators.transport import LIMIT_PARAMS, RETRY_PARAMS, Limits, Transport, check_endpoint

if TYPE_CHECKING:
    from animastor_tasks.config import Settings
    from animastor_tasks.domain.registry import StageSpec

# Params the generator reads itself; they are never sent to the server.
CLIENT_PARAMS = LIMIT_PARAMS | RETRY_PARAMS
# Extra attempts made inside one job when the server answers 5xx/408/429 with Retry-After.
DEFAULT_RETRIES = 2
OCTET_STREAM = "application/octet-stream"


def route_url(stage: str, generator: str, endpoint: str | None, route: str) -> str:
    """The URL to call: the endpoint itself when it already ends with `route`, else `route` under it.

    So both the full route (`http://gpu:8000/v1/audio/speech`) and the base URL an OpenAI
    client would take (`http://gpu:8000/v1`) work.
    """
    url = check_endpoint(stage, generator, endpoint)
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if path.endswith(route):
        return url
    return urlunsplit(parts._replace(path=path + route))


def string_param(
    params: Mapping[str, Any],
    key: str,
    default: str | None,
    *,
    choices: Collection[str] | None = None,
    pattern: re.Pattern[str] | None = None,
) -> str:
    """Read a string param; a missing or bad one is a non-retryable GeneratorError naming it."""
    value = params.get(key, default)
    if value is None:
        raise GeneratorError(f"param {key!r} is required", misconfigured=True)
    ok = isinstance(value, str) and bool(value.strip())
    if ok and choices is not None and value not in choices:
        ok = False
    if ok and pattern is not None and not pattern.fullmatch(value):
        ok = False
    if not ok:
        expected = f"one of {sorted(choices)}" if choices is not None else "a non-empty string"
        if pattern is not None:
            expected = f"a string matching {pattern.pattern!r}"
        raise GeneratorError(f"param {key!r} must be {expected}, got {value!r}", misconfigured=True)
    return str(value)


def media_type_of(response: requests.Response) -> str:
    """The response's Content-Type without parameters, lower-cased ('' when absent)."""
    return base_type(response.headers.get("Content-Type", ""))


class OpenAIGenerator:
    """Common set-up of the OpenAI-compatible generators: the URL, the transport, the request."""

    name: ClassVar[str]
    route: ClassVar[str]
    # Body fields the generator sets itself; params of these names are not passed through.
    own_fields: ClassVar[frozenset[str]]

    def __init__(self, spec: StageSpec, settings: Settings) -> None:
        self.spec = spec
        self.url = route_url(spec.name, self.name, spec.endpoint, self.route)
        self._api_key = settings.inference_api_key
        self._transport = Transport(spec.name, self.url, self._api_key)
        # The stage's params, read as each job reads them: a bad or missing one stops the worker's start
        # (`refuse_generators_not_built`). *Why:* the worker started healthy and failed every job `misconfigured`.
        Limits.from_params(spec.params, retries=DEFAULT_RETRIES)
        self._fields(spec.params)

    def _fields(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The body fields this generator sets itself from `params`, each checked (none here: a subclass's own)."""
        return {}

    def _params(self, request: GenerationRequest) -> dict[str, Any]:
        return {**self.spec.params, **request.params}

    def _extra_fields(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Params the generator does not know (`speed`, `quality`, ...) go to the server as body fields."""
        return {k: v for k, v in params.items() if k not in CLIENT_PARAMS and k not in self.own_fields}

    def _post(
        self,
        body: Mapping[str, Any],
        accept: str,
        params: Mapping[str, Any],
        request: GenerationRequest,
        should_stop: Callable[[], bool],
        progress: Callable[[float], None],
        check_type: Callable[[requests.Response], str],
    ) -> tuple[str, bytes]:
        limits = Limits.from_params(params, retries=DEFAULT_RETRIES)
        headers = {"Accept": accept}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        self._transport.check_stop(should_stop, request)
        progress(0.0)
        return self._transport.post(body, headers, limits, request, should_stop, check_type)

    def _fail(self, message: str, *, misconfigured: bool = False, retryable: bool = False) -> GeneratorError:
        """A response the server should not have sent: the same request would get it again. `misconfigured`:
        one that says the endpoint is not the server it should be (a confused content type), whatever the scene.
        `retryable`: one cut short by a dropped connection, or no media at all (a broken model's error text under
        the media type): not the scene's doing, so worth another attempt and counted by the breaker."""
        return GeneratorError(
            f"stage {self.spec.name!r}: inference endpoint {message}", retryable=retryable, misconfigured=misconfigured
        )
