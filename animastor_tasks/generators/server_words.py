"""What an inference server says besides its media, read the same by every generator: when to come back
(`Retry-After`, seconds or an HTTP date), how long its body says it is, the message of a JSON error body and the
fields it refuses, its words made safe to print; and which request errors say that no retry can succeed."""

from __future__ import annotations

import email.utils
import ssl
from datetime import UTC, datetime

import requests
import urllib3


def json_error(payload: object) -> str | None:
    """The message of a JSON error body: `{"error": "..."}`, OpenAI's `{"error": {"message": ...}}` or FastAPI's
    `{"detail": "..."}`; None for JSON of another shape."""
    if not isinstance(payload, dict):
        return None
    error = payload.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    if not isinstance(error, str):
        error = payload.get("detail")
    return error if isinstance(error, str) else None


def refused_fields(payload: object) -> frozenset[str]:
    """The request fields a JSON error body names as refused: OpenAI's `{"error": {"param": "voice"}}` (vLLM's
    `param` at the top), FastAPI's `{"detail": [{"loc": ["body", "speed"], ...}]}` (the last name after the root:
    a list's index is no name); none for another shape. Read defensively: the body is whatever the server sent."""
    if not isinstance(payload, dict):
        return frozenset()
    error = payload.get("error")
    params = (error.get("param") if isinstance(error, dict) else None, payload.get("param"))
    found = {param for param in params if isinstance(param, str) and param}
    detail = payload.get("detail")
    for item in detail if isinstance(detail, list) else ():
        where = item.get("loc") if isinstance(item, dict) else None
        names = [part for part in where[1:] if isinstance(part, str)] if isinstance(where, list) else []
        if names:
            found.add(names[-1])
    return frozenset(found)


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds a `Retry-After` header asks for (delta-seconds or HTTP-date); None if absent or unreadable."""
    if not value or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, OverflowError):  # a year past datetime's
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if seconds != seconds:  # NaN
        return None
    return max(0.0, seconds)


def declared_length(value: str | None) -> int:
    """A Content-Length in ASCII digits (others ignored, as urllib3 ignores them), or -1. *Why:* `²` passes
    `str.isdigit` and fails `int`, as 5,000 digits do past its digit limit: a ValueError, a bug, failed every scene of
    the lane for good. Digits past the 19 of any count this host could read say more than any `max_bytes`."""
    declared = (value or "").strip()
    if not (declared.isascii() and declared.isdigit()):
        return -1
    digits = declared.lstrip("0")  # zeros ahead count for nothing: `0004` is 4
    return int(digits or "0") if len(digits) <= 19 else 10**19


# Request errors that another attempt cannot fix (`why_permanent`).
_PERMANENT_REQUEST_ERRORS = (
    urllib3.exceptions.LocationParseError,  # a host no connection can be opened to (`gpu..box`), as urllib3 says it
    requests.exceptions.InvalidURL,
    requests.exceptions.InvalidHeader,
    requests.exceptions.InvalidSchema,
    requests.exceptions.MissingSchema,
    requests.exceptions.InvalidJSONError,  # a param no JSON body can carry (NaN, an infinity): the stage's setting
)


def why_permanent(err: Exception) -> str | None:
    """Why another attempt cannot succeed, whatever the scene (None if it may): the endpoint, a header or the proxy is
    wrong, the server's certificate is not one this host trusts (self-signed, another host's, expired), or an https
    URL names a port that speaks plain HTTP. *Why the last two:* each job spent its retries and their backoff on
    them before the breaker opened."""
    reason = getattr(err.args[0], "reason", None) if err.args else None  # requests' SSLError wraps urllib3's
    tls = reason.args[0] if isinstance(reason, urllib3.exceptions.SSLError) and reason.args else None
    if isinstance(tls, ssl.SSLCertVerificationError):
        return "a certificate this host does not trust"
    if isinstance(tls, ssl.SSLError) and tls.reason == "WRONG_VERSION_NUMBER":
        return "the port speaks plain HTTP, not TLS: use http:// or the server's TLS port"
    return "a wrong endpoint or header" if isinstance(err, _PERMANENT_REQUEST_ERRORS) else None
