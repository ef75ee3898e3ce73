"""Every error this package raises on purpose.

    AnimastorError
     ├── ConfigError          a setting from the environment is missing or malformed
     ├── InvalidInput         a caller sent something we refuse (nothing was written)
     │    ├── InvalidBook     a book file that cannot be imported
     │    └── InvalidCommand  a regenerate/cancel/layers call that cannot be carried out
     ├── DuplicateCommand     a command id that was already used (a resend: replayed, not redone)
 ├── InvalidTransition    an asset state change the FSM does not allow
     ├── StoreUnavailable     Postgres, Redis or the broker cannot be reached
     ├── ArtifactStoreError   the artifact store refused the bytes or cannot be reached
     └── GeneratorError       a generator failed to produce media
          └── GenerationStopped  the job was told to stop (cancel, lost lease)

Driver errors are translated at the adapter edge so that no caller ever sees a
raw psycopg/redis/kombu traceback.
"""

from __future__ import annotations

import re

_BLANKS = re.compile(r"(\s+)")
# A query parameter (of a URL, or of a path quoted alone, as urllib3 does): its value up to the next one.
_QUERY_PARAM = re.compile(r"(?P<lead>[?&](?P<name>[A-Za-z0-9_.-]+)=)(?P<value>[^&\s'\"]*)")
# libpq's keyword form (`host=db password='a b'`): a password's value, quoted (with `\'` escapes) or up to a blank.
_KEYWORD_PASSWORD = re.compile(
    r"(?<![\w?&.-])(?P<lead>(?:ssl)?password\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s']\S*|'\S*)", re.I
)
# A parameter whose value is a secret: a name, or one of its `_`/`-`/`.` words, ending so (`password`, libpq's
# `sslpassword`, redis-py's `ssl_password`, `api_key`, `access_token`, S3's `X-Amz-Signature`, Azure's `sig`).
_SECRET_WORDS = ("password", "passwd", "pwd", "passphrase", "secret", "token", "key", "signature", "sig", "auth")


def redact_url(text: str) -> str:
    """Hide the passwords of the URLs in `text` (and of libpq's keyword form), and the values of their secret-like
    query parameters, so it can be printed or logged. When in doubt it hides more: a password must never be
    shown, a host may be."""
    text = _KEYWORD_PASSWORD.sub(lambda m: f"{m['lead']}***", text)
    text = "".join(_hide_login(word) for word in _BLANKS.split(text))
    return _QUERY_PARAM.sub(lambda m: f"{m['lead']}***" if is_secret_param(m["name"]) and m["value"] else m[0], text)


def _hide_login(word: str) -> str:
    """`word` (no blank) with the password of its first URL login hidden: from the `:` after the user to the LAST
    `@` of the word, since `@`, `/`, `?` and `#` typed unencoded in a password (a base64 one has `/`) end the
    authority early for a parser, whose split would leave the rest shown. By hand, not a regex: one with a
    backtracking scheme took seconds on a server's 64 KB error body without a blank."""
    at = word.rfind("@")
    for found in re.finditer("://", word[:at] if at > 0 else ""):
        start = found.end()
        colon = word.find(":", start, at)
        if found.start() > 0 and colon != -1 and not any(ch in word[start:colon] for ch in "/@"):
            return f"{word[:colon]}:***{word[at:]}"
    return word


def is_secret_param(name: str) -> bool:
    """Whether a query parameter of this name holds a secret (`redact_url` hides its value)."""
    return any(word.rstrip("s").endswith((*_SECRET_WORDS, "credential")) for word in re.split(r"[_.-]", name.lower()))


class AnimastorError(Exception):
    """Root of every error raised on purpose by animastor-tasks.

    An error with fields keeps its constructor's arguments as `args` and says its message in `__str__`:
    Celery sends a task's exception to its caller as the type and `args` (JSON) and rebuilds it as
    `type(*args)`. Built from the message alone, a `StoreUnavailable` could not be rebuilt, and the caller got
    a bare `Exception` (a traceback and exit code 1 where the CLI answers 3 with the store named).
    """

    #: Set by the client on what a regenerate call raises: the command id a retry must resend (the command may
    #: have been sent, and a new id would make it a second command).
    command_id: str | None = None


class ConfigError(AnimastorError):
    """A setting from the environment is missing or malformed."""


class InvalidInput(AnimastorError):
    """Input refused before anything was written."""


class InvalidBook(InvalidInput):
    """A book document that cannot be imported."""


class InvalidCommand(InvalidInput):
    """A regenerate, cancel or layers request that cannot be carried out."""


class DuplicateCommand(AnimastorError):
    """A command id that a concurrent or earlier regenerate already used."""


class InvalidTransition(AnimastorError):
    """An asset state change the FSM does not allow."""

    def __init__(self, source: str, target: str) -> None:
        super().__init__(source, target)
        self.source = source
        self.target = target

    def __str__(self) -> str:
        return f"asset state cannot move from {self.source!r} to {self.target!r}"


class StoreUnavailable(AnimastorError):
    """Postgres, Redis or the broker cannot be reached or answered with an error."""

    def __init__(self, store: str, url: str, detail: str) -> None:
        self.store = store
        self.url = redact_url(url)
        self.detail = detail
        super().__init__(store, self.url, detail)

    def __str__(self) -> str:
        return f"{self.store} unavailable at {self.url}: {self.detail}"


class BookBusy(StoreUnavailable):
    """A claim found its book's lock held past a short wait: another transaction works on the whole book (an import,
    a regenerate, a Stop All). Not an outage: a refill hands the slot to the next waiting book instead."""

    def __init__(self, book: str, waited: float) -> None:
        super().__init__("postgres", "", f"book {book!r} busy: its lock held by another transaction past {waited:g}s")
        self.book, self.waited = book, waited
        self.args = (book, waited)  # rebuilt as `type(*args)` across a Celery result (see `AnimastorError`)

    def __str__(self) -> str:
        return self.detail


class DeliveryNotStarted(StoreUnavailable):
    """A delivered job could not start: Redis did not answer its delivery's start, tried for a few seconds. Nothing
    of the job ran; its message goes back to the broker for the next delivery (`worker/tasks.py`)."""


class JobFailed(AnimastorError):
    """A GPU job whose scene failed for good (its pair `failed`, its verdict written): its task ends with it, so Flower
    and the result store show the job FAILURE, not SUCCESS. Expected (`throws`): logged at INFO, without a traceback
    (the job's own `[GENERATE] ... failed` line is the ERROR)."""

    def __init__(self, job: str, error: str) -> None:
        super().__init__(job, error)
        self.job = job
        self.error = error

    def __str__(self) -> str:
        return f"{self.job} failed: {self.error}"


class ArtifactStoreError(AnimastorError):
    """The artifact store refused an upload or cannot be reached (wrong credentials, a missing bucket, a full
    disk, the endpoint down): no verdict on the scene, so the pair goes back and the queue's breaker counts it.
    `unreachable`: the store did not answer, or answered that it cannot serve now (a 5xx, SlowDown): the job, its
    output in hand, asks again for a while. `timed_out`: the job's soft time limit ended the upload, as it ends a
    generator that hangs: counted as a backend failure."""

    def __init__(self, store: str, detail: str, *, unreachable: bool = False, timed_out: bool = False) -> None:
        self.store = redact_url(store)
        self.detail = detail
        self.unreachable = unreachable
        self.timed_out = timed_out
        super().__init__(self.store, detail)

    def __str__(self) -> str:
        return f"artifact store {self.store}: {self.detail}"


class GeneratorError(AnimastorError):
    """A generator failed; `retryable` says whether another attempt may succeed, and `retry_after` (seconds)
    when the backend said when to try again (HTTP `Retry-After`), for the worker's backoff. `misconfigured`:
    the stage's setup is wrong or its server refuses every request (a redirect, a rejected key, a wrong route,
    a confused content type, a bad param): not worth a retry, and no verdict on the scene either, so it counts
    against the queue's breaker rather than failing every pair of the lane. `rate_limited`: the backend refused
    for now, whoever asked (HTTP 429, or 503 naming a Retry-After): retried, and no verdict on the scene either
    once the retries are spent."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = True,
        retry_after: float | None = None,
        misconfigured: bool = False,
        rate_limited: bool = False,
    ) -> None:
        super().__init__(message)
        self.retryable = (retryable or rate_limited) and not misconfigured
        self.retry_after = retry_after
        self.misconfigured = misconfigured
        self.rate_limited = rate_limited and not misconfigured


class GenerationStopped(GeneratorError):
    """The job was asked to stop (book cancelled or lease lost) and produced nothing."""

    def __init__(self, message: str = "generation stopped") -> None:
        super().__init__(message, retryable=False)
