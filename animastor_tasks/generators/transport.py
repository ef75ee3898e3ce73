"""The HTTP behaviour every remote generator shares, so each protocol gets it right once.

One POST to one configured URL: redirects are refused rather than followed (the key and
the scene text must not be sent anywhere else), and no credentials but the generator's own
go with it (requests would add a `~/.netrc` entry's); connect and read timeouts are bounded,
and so is the whole answer (`total_timeout`: a server trickling bytes resets the read timeout
with each); a stop or that deadline cuts the connection wherever the request waits
(`watchdog.py`); the body is read as it arrives (a huge body is cut off); 5xx/408/429 are
retryable and other 4xx are not, and an error carries the server's own message with the API
key and the endpoint's query tokens scrubbed out and its line breaks and control characters
escaped. When a server says when to come back (`Retry-After`), the generator can wait that
long itself, capped, and an error it gives up with carries the hint on to the worker's backoff.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, unquote_plus, urljoin, urlsplit

import requests
import urllib3

from animastor_tasks.domain.book import printable
from animastor_tasks.errors import ConfigError, GenerationStopped, GeneratorError, is_secret_param, redact_url
from animastor_tasks.generators import GenerationRequest, number_param
from animastor_tasks.generators.server_words import (
    declared_length,
    json_error,
    refused_fields,
    retry_after_seconds,
    why_permanent,
)
from animastor_tasks.generators.watchdog import Watchdog, watched_session

log = logging.getLogger(__name__)

# 4xx answers that mean "not now" rather than "never": worth another attempt.
RETRYABLE_4XX = frozenset({408, 429})
# Refusals of the endpoint itself, whatever the scene (a key, a route, a method, a proxy's credentials, the
# body's or the answer's format, the protocol).
MISCONFIGURED_4XX = frozenset({401, 403, 404, 405, 406, 407, 415, 426})
# Refusals of the request's content: misconfigured when they name a field other than the scene's own (its text or
# prompt, its ids), a stage setting such as `voice` or `speed` then. *Why:* a wrong voice failed every scene for good.
FIELD_4XX = frozenset({400, 422})
SCENE_FIELDS = frozenset({"input", "prompt", "book_id", "chapter_id", "scene_id"})
# What a server's error page comes as: never media, even for a stage that stores whatever bytes it is sent.
ERROR_PAGE_TYPES = frozenset({"application/json", "text/html"})
# Params read by the transport itself (never sent to a server).
LIMIT_PARAMS = frozenset({"connect_timeout", "read_timeout", "total_timeout", "max_bytes"})
RETRY_PARAMS = frozenset({"retries", "max_retry_after"})
_CHUNK = 64 * 1024
_MESSAGE_LIMIT = 300
_ERROR_BODY_LIMIT = 64 * 1024
_SLEEP_SLICE = 0.05  # a stop request is noticed within this long while waiting out a Retry-After
# What reading the body itself may raise (read straight from urllib3, not through requests' wrappers).
_BODY_READ_ERRORS = (urllib3.exceptions.HTTPError, OSError)


def _no_credentials(request: requests.PreparedRequest) -> requests.PreparedRequest:
    """An `auth` that adds nothing: without one, requests sends a `~/.netrc` entry's login (a `default` entry for
    any host), in clear to a server of someone else's, and in place of the OpenAI generators' Bearer key."""
    return request


CheckType = Callable[[requests.Response], str]


@dataclass(frozen=True)
class Limits:
    """Timeouts, body size and in-generator retries for one request (params of the stage)."""

    connect_timeout: float = 3.05
    read_timeout: float = 300.0
    total_timeout: float = 600.0  # the whole answer, from sending to its last byte
    max_bytes: int = 512 * 1024 * 1024
    retries: int = 0  # extra attempts, only when the server sent Retry-After
    max_retry_after: float = 30.0

    @classmethod
    def from_params(cls, params: Mapping[str, Any], *, retries: int = 0) -> Limits:
        """Read the limit params; `retries` is the default (0 keeps the retry params unread)."""
        connect = number_param(params, "connect_timeout", 3.05, minimum=0.001, maximum=600.0)
        read = number_param(params, "read_timeout", 300.0, minimum=0.001, maximum=86400.0)
        total = number_param(params, "total_timeout", 2 * read, minimum=0.001, maximum=172800.0)
        max_bytes = int(number_param(params, "max_bytes", 512 * 1024 * 1024, minimum=1, integer=True))
        if not retries:
            return cls(connect, read, total, max_bytes)
        extra = int(number_param(params, "retries", retries, minimum=0, maximum=10, integer=True))
        cap = number_param(params, "max_retry_after", 30.0, minimum=0.0, maximum=3600.0)
        return cls(connect, read, total, max_bytes, extra, cap)


def check_endpoint(stage: str, generator: str, endpoint: str | None) -> str:
    """The stage's endpoint, or ConfigError when it is missing or not an http(s) URL."""
    if not endpoint:
        raise ConfigError(f"stage {stage!r}: generator {generator!r} needs an endpoint URL")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"stage {stage!r}: endpoint {redact_url(endpoint)!r} is not an http(s) URL")
    if parts.username is not None or parts.password is not None:
        # Never sent (the request's only credential is the worker's key): the server answered 401 to every scene.
        raise ConfigError(
            f"stage {stage!r}: endpoint {redact_url(endpoint)!r} carries a login, which is not sent; the worker"
            " authenticates with ANIMASTOR_INFERENCE_API_KEY only: take the login out of the URL"
        )
    return endpoint


class Transport:
    """POSTs to one URL for one stage; every failure is a GeneratorError saying whether to retry."""

    def __init__(self, stage: str, url: str, secret: str = "") -> None:
        self.stage = stage
        self.url = url
        self.shown_url = redact_url(url)
        self._secrets = sorted({secret, *_query_secrets(url)} - {""}, key=len, reverse=True)

    def post(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        limits: Limits,
        request: GenerationRequest,
        should_stop: Callable[[], bool],
        check_type: CheckType,
    ) -> tuple[str, bytes]:
        """(media type from `check_type`, body bytes) of a 200; the caller checks stop before the first send."""
        attempt = 0
        media_type, data = "", b""
        while True:
            wait: float | None = None
            with Watchdog(should_stop, time.monotonic() + limits.total_timeout) as watchdog:
                try:
                    with watched_session() as session, self._send(session, body, headers, limits) as response:
                        wait = self._retry_wait(response, attempt, limits)
                        if wait is None:
                            self._check_status(response)
                            media_type = check_type(response)
                            data = self._read_body(response, limits, should_stop, request)
                except (requests.exceptions.RequestException, urllib3.exceptions.LocationParseError) as err:
                    # Connection refused, DNS failure, connect/read timeout, connection reset mid-body.
                    self._check_cut(watchdog, limits, request)
                    why = why_permanent(err)
                    raise GeneratorError(
                        f"stage {self.stage!r}: inference endpoint {self.shown_url} failed: "
                        f"{type(err).__name__}: {self.clean(str(err))}" + (f" ({why})" if why else ""),
                        misconfigured=why is not None,
                    ) from None
                except GeneratorError:
                    self._check_cut(watchdog, limits, request)
                    raise
                self._check_cut(watchdog, limits, request)  # a cut body without a length reads as one that ended
            if wait is None:
                break
            attempt += 1
            self._sleep(wait, should_stop, request)
        self.check_stop(should_stop, request)
        if not data:  # a server dead after its headers, or one whose model broke: no media, whatever the scene
            raise GeneratorError(f"stage {self.stage!r}: inference endpoint returned an empty body", retryable=True)
        return media_type, data

    def _send(
        self, session: requests.Session, body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits
    ) -> requests.Response:
        """The POST, its redirects never followed (nor read: `_unfollowed`)."""
        try:
            return session.post(
                self.url,
                json=body,
                headers=dict(headers),
                auth=_no_credentials,
                timeout=(limits.connect_timeout, limits.read_timeout),
                allow_redirects=False,
                stream=True,
                hooks={"response": _unfollowed},
            )
        except _Redirect as redirect:
            return redirect.response  # its body unread: `_check_status` refuses it from its headers

    def _retry_wait(self, response: requests.Response, attempt: int, limits: Limits) -> float | None:
        """Seconds to wait before trying again, when the server asked for it and attempts remain."""
        status = response.status_code
        if attempt >= limits.retries or not (status >= 500 or status in RETRYABLE_4XX):
            return None
        asked = retry_after_seconds(response.headers.get("Retry-After"))
        if asked is None:
            return None  # no hint: the worker's own backoff decides
        wait = min(asked, limits.max_retry_after)
        log.warning(
            "stage %s: %s answered %d (%s); Retry-After %.1fs, retry %d/%d in %.1fs",
            self.stage,
            self.shown_url,
            status,
            self.server_message(response),
            asked,
            attempt + 1,
            limits.retries,
            wait,
        )
        return wait

    def _sleep(self, seconds: float, should_stop: Callable[[], bool], request: GenerationRequest) -> None:
        deadline = time.monotonic() + seconds
        while True:
            self.check_stop(should_stop, request)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(_SLEEP_SLICE, left))

    def _check_status(self, response: requests.Response) -> None:
        status = response.status_code
        if status == 200:
            return
        if status < 200:
            # An interim answer (102 Processing, 103 Early Hints) the HTTP client takes for the final one (it skips
            # only a 100): its empty body failed each scene in turn as a verdict on the scene, the breaker told nothing.
            raise GeneratorError(
                f"stage {self.stage!r}: inference endpoint answered {status}, an interim status the worker's HTTP"
                " client cannot read past; the endpoint must answer with its final status directly",
                misconfigured=True,
            )
        if 200 <= status < 300:
            # An API that creates (201), queues (202) or answers nothing (204) is not the protocol's: it answers
            # every scene so, and its body may be the media itself, no message to quote.
            raise GeneratorError(
                f"stage {self.stage!r}: inference endpoint answered {status}, not 200 with the media;"
                " point the stage at an endpoint that answers with the media itself",
                misconfigured=True,
            )
        if 300 <= status < 400:
            location = response.headers.get("Location", "")
            try:
                host = urlsplit(urljoin(self.url, location)).hostname if location else None
            except ValueError as err:  # `http://[gpu-box/v1`: a bare ValueError was a generator bug, a traceback
                raise GeneratorError(
                    f"stage {self.stage!r}: inference endpoint answered a redirect to a Location that cannot be read"
                    f" ({self.clean(str(err))}); redirects are refused, configure the final URL as the endpoint",
                    misconfigured=True,
                ) from None
            raise GeneratorError(
                f"stage {self.stage!r}: inference endpoint answered {status} redirecting to host "
                f"{self.clean(host or 'unknown')!r}; redirects are refused, configure the final URL as the endpoint",
                misconfigured=True,
            )
        message, _, fields = self._message_in(self._error_body_text(response))
        retryable = status >= 500 or status in RETRYABLE_4XX
        retry_after = retry_after_seconds(response.headers.get("Retry-After")) if retryable else None
        raise GeneratorError(
            f"stage {self.stage!r}: inference endpoint answered {status}: {message}",
            retryable=retryable,
            retry_after=retry_after,
            misconfigured=status in MISCONFIGURED_4XX or (status in FIELD_4XX and bool(fields - SCENE_FIELDS)),
            # A 503 that says when to come back is a server refusing whoever asks (a model loading, a queue full), as
            # a 429 is. *Why:* taken as the scene's fault, it failed scenes for good until the breaker opened.
            rate_limited=status == 429 or (status == 503 and retry_after is not None),
        )

    def _read_body(
        self,
        response: requests.Response,
        limits: Limits,
        should_stop: Callable[[], bool],
        request: GenerationRequest,
    ) -> bytes:
        """Read the body as it arrives (one socket read at a time: a read of a whole chunk waited for all of it),
        so a stop is seen during a long or trickling download and a huge body is cut off (at once when it says so)."""
        if declared_length(response.headers.get("Content-Length")) > limits.max_bytes:
            raise self._too_big(limits)
        data = bytearray()
        while True:
            try:
                chunk = response.raw.read1(_CHUNK, decode_content=True)
            except _BODY_READ_ERRORS as err:  # a read timeout, a reset mid-body, a broken compression
                raise GeneratorError(
                    f"stage {self.stage!r}: reading the answer of {self.shown_url} failed: "
                    f"{type(err).__name__}: {self.clean(str(err))}"
                ) from None
            if not chunk:
                return bytes(data)
            data += chunk
            if len(data) > limits.max_bytes:
                raise self._too_big(limits)
            self.check_stop(should_stop, request)

    def _too_big(self, limits: Limits) -> GeneratorError:
        return GeneratorError(
            f"stage {self.stage!r}: inference response exceeds max_bytes={limits.max_bytes}", retryable=False
        )

    def _check_cut(self, watchdog: Watchdog, limits: Limits, request: GenerationRequest) -> None:
        """What the watchdog's cut of the connection means, rather than the error the cut caused."""
        if watchdog.why == "stopped":
            raise _stopped(request)
        if watchdog.why == "deadline":
            raise GeneratorError(
                f"stage {self.stage!r}: inference endpoint {self.shown_url} had not sent its whole answer after"
                f" total_timeout={limits.total_timeout:g}s"
            )

    def server_message(self, response: requests.Response) -> str:
        """The server's error text (`{"error": "..."}`, OpenAI's `{"error": {"message": ...}}` or
        `{"detail": "..."}`), or the start of whatever it sent instead."""
        return self._message_in(self._error_body_text(response))[0]

    def _error_body_text(self, response: requests.Response) -> str:
        """The start of an error answer's body, as text."""
        raw = bytearray()
        try:
            for chunk in response.iter_content(_CHUNK):
                raw += chunk
                if len(raw) >= _ERROR_BODY_LIMIT:
                    break
        except requests.exceptions.RequestException:
            pass  # the status alone still says what happened
        return raw[:_ERROR_BODY_LIMIT].decode("utf-8", errors="replace")

    def _message_in(self, text: str) -> tuple[str, bool, frozenset[str]]:
        """(the message of an error body, whether it is one the server wrote as an error, the fields it refuses)."""
        try:
            payload = json.loads(text)
        except (ValueError, RecursionError):  # nested past the parser's depth: read as the text it is
            return self.clean(text.strip()) or "(empty body)", False, frozenset()
        said = json_error(payload)
        # Another shape is quoted as JSON written again here: the key, if echoed, is spelled as `clean` looks for it,
        # not in the server's own escapes (`\u003c` for `<`, `\/` for `/`) that hid it.
        text = said if said is not None else json.dumps(payload, ensure_ascii=False)
        return self.clean(text.strip()) or "(empty body)", said is not None, refused_fields(payload)

    def json_instead(self, response: requests.Response, expected: str) -> GeneratorError:
        """The error for a 200 that answered JSON where `expected` media was asked for. An error under 200 (a model
        still loading) is the server's words and worth another attempt; other JSON is its answer to every scene.
        *Why:* every such answer was `misconfigured` without the server's words, the first scenes failed for good."""
        message, is_error, _ = self._message_in(self._error_body_text(response))
        if is_error:
            return GeneratorError(f"stage {self.stage!r}: inference endpoint answered 200 with an error: {message}")
        return GeneratorError(
            f"stage {self.stage!r}: inference endpoint returned JSON, expected {expected}: {message}",
            misconfigured=True,
        )

    def clean(self, message: str) -> str:
        """Shorten a message, make sure the API key and the endpoint's query tokens cannot leak through it (even if
        echoed back), and write its line breaks and control characters as escapes (`printable`)."""
        for secret in self._secrets:  # in any case: a URL parser lower-cases a host that echoes the key
            for form in dict.fromkeys((secret, json.dumps(secret)[1:-1])):
                message = re.sub(re.escape(form), "***", message, flags=re.IGNORECASE)
        message = printable(redact_url(message))
        return message if len(message) <= _MESSAGE_LIMIT else message[:_MESSAGE_LIMIT] + "..."

    def check_stop(self, should_stop: Callable[[], bool], request: GenerationRequest) -> None:
        if should_stop():
            raise _stopped(request)


def _query_secrets(url: str) -> set[str]:
    """The values of the endpoint's secret-like query parameters (`?api_key=...`), as written and decoded: a server
    or urllib3 may quote them back, named or not. Shorter than 4 characters, no token (and scrubbed, it would mangle
    every message)."""
    found: set[str] = set()
    for pair in urlsplit(url).query.split("&"):
        name, _, value = pair.partition("=")
        if is_secret_param(unquote_plus(name)):
            found |= {v for v in (value, unquote(value), unquote_plus(value)) if len(v) >= 4}
    return found


class _Redirect(Exception):  # an answer to hand back, not an error
    def __init__(self, response: requests.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _unfollowed(response: requests.Response, *args: Any, **kwargs: Any) -> requests.Response:
    """A redirect is handed back before requests reads it. *Why:* requests reads the whole body of a redirect it
    does not follow (to free the connection), into memory and with no `max_bytes`: a server answering 302 with a
    body of gigabytes held the job for its `total_timeout` and could kill the worker for its memory."""
    if response.is_redirect:
        raise _Redirect(response)
    return response


def _stopped(request: GenerationRequest) -> GenerationStopped:
    return GenerationStopped(f"generation stopped for scene {request.scene_id} stage {request.stage}")
