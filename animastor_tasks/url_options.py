"""The query options of the Redis and broker URLs, checked when the settings are built.

*Why:* they were read first when a client was made: `?socket_timeout=abc`, `?foo=1` or `?ssl_cert_reqs=bogus`
was a ValueError, TypeError or KeyError traceback (exit 1) from `cancel`, `status` or a GPU worker's start, not
the ConfigError naming the variable that every other bad value gives. *Why by hand:* the settings sit below the
ports, which import no driver (pyproject.toml's contracts), so they cannot ask redis-py or kombu;
tests/unit/test_url_options.py holds these lists to the installed drivers.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable
from urllib.parse import parse_qsl, urlsplit

from animastor_tasks.errors import ConfigError, redact_url

Rule = tuple[Callable[[str], bool], str]  # (can the client read this value, what it takes)


def _number(value: str) -> bool:
    try:
        return math.isfinite(float(value)) and float(value) >= 0
    except ValueError:
        return False


def _known(lookup: Callable[[str], object]) -> Callable[[str], bool]:
    def check(value: str) -> bool:
        try:
            lookup(value)
        except LookupError:
            return False
        return True

    return check


def _one_of(*values: str) -> Rule:
    return (lambda value: value in values, f"one of {', '.join(values)}")


NUMBER: Rule = (_number, "a finite number, 0 or more")
WHOLE: Rule = (str.isdigit, "a whole number, 0 or more")
# A socket's timeout and read size: 0 made redis-py's sockets non-blocking (every read failed: a control worker took
# regenerates and Stop Alls off its queue and lost them).
TIMEOUT: Rule = (lambda value: _number(value) and float(value) > 0, "a finite number above 0")
COUNT: Rule = (lambda value: value.isdigit() and int(value) > 0, "a whole number above 0")
FLAG: Rule = (lambda value: value.lower() in ("true", "false", "yes", "no", "1", "0"), "true or false")
# kombu hands an AMQP URL's `ssl` on as text, and any text is true: `?ssl=false` turned TLS on.
ON: Rule = (lambda value: value.lower() in ("true", "yes", "1"), "true (kombu reads any value as true: leave it out)")
TEXT: Rule = (lambda value: True, "")
# What Redis takes as a client's name: its refusal of a blank came at every connection, reported as Redis down.
NAME: Rule = (lambda value: all("!" <= ch <= "~" for ch in value), "printable ASCII without blanks")

REDIS_PY: dict[str, Rule] = {  # what redis-py's pool and connections take from a URL, with the types it reads
    "db": WHOLE,
    "socket_timeout": TIMEOUT,
    "socket_connect_timeout": TIMEOUT,
    "socket_read_size": COUNT,
    "health_check_interval": WHOLE,
    "max_connections": WHOLE,  # 0: redis-py's default (100)
    "retry_on_timeout": FLAG,
    # redis-py's exception class names, comma-separated (it reads the names themselves)
    "retry_on_error": (lambda value: all(n.strip().isidentifier() for n in value.strip("[]").split(",")), "names"),
    "legacy_responses": FLAG,
    "protocol": _one_of("2", "3"),
    "client_name": NAME,
    "lib_name": TEXT,  # CLIENT SETINFO: a refusal is ignored by redis-py
    "lib_version": TEXT,
    "username": TEXT,
    "password": TEXT,
    "encoding": (_known(codecs.lookup), "a Python codec"),
    "encoding_errors": (_known(codecs.lookup_error), "a Python codec error handler"),
}
REDIS_PY_TCP: dict[str, Rule] = {"socket_keepalive": FLAG}  # not a socket file's
REDIS_PY_TLS: dict[str, Rule] = {  # a rediss:// URL's only
    "ssl_cert_reqs": _one_of("none", "optional", "required"),
    "ssl_check_hostname": FLAG,
    "ssl_validate_ocsp": FLAG,
    "ssl_validate_ocsp_stapled": FLAG,
    **dict.fromkeys(
        ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_password", "ssl_ciphers"),
        TEXT,
    ),
}
# kombu reads the TLS options itself (its certificate requirement in either spelling), then hands them to redis-py.
KOMBU_TLS: dict[str, Rule] = {
    **REDIS_PY_TLS,
    "ssl_cert_reqs": _one_of("none", "optional", "required", "CERT_NONE", "CERT_OPTIONAL", "CERT_REQUIRED"),
    "ssl_check_hostname": TEXT,  # anything but `false` is true to kombu
}
KOMBU_SOCKET: dict[str, Rule] = {"virtual_host": WHOLE, **KOMBU_TLS}  # a host URL's database is its path only
KOMBU_AMQP: dict[str, Rule] = {
    "heartbeat": NUMBER,
    # kombu hands it on as text, and every connection failed (a TypeError in the client, the worker and beat)
    "connect_timeout": (lambda value: False, "left out: kombu passes it on as text, which no connection can use"),
    "login_method": _one_of("AMQPLAIN", "PLAIN", "EXTERNAL", "GSSAPI"),
    "ssl": ON,
    "insist": FLAG,  # py-amqp ignores it, whatever its value
    **KOMBU_TLS,
}


def redis_py_options(scheme: str) -> dict[str, Rule]:
    """The options redis-py takes from a URL of this scheme."""
    extra = {"unix": {}, "redis": REDIS_PY_TCP, "rediss": {**REDIS_PY_TCP, **REDIS_PY_TLS}}
    return {**REDIS_PY, **extra.get(scheme, {})}


def check_redis_options(name: str, url: str) -> None:
    """The options of a URL the runtime's own redis-py client (and the result store) reads."""
    _check(name, url, redis_py_options(urlsplit(url).scheme), "redis-py")
    _check_certificate_named(name, url)


def check_redis_path(name: str, url: str) -> None:
    """A database that is a number. *Why:* redis-py takes a path that is no number (`/animastor`, as a
    namespace) as database 0, another application's maybe."""
    path = urlsplit(url).path
    database = path.lstrip("/")
    if path.count("/") > 1 or (database and not database.isdigit()):
        raise ConfigError(f"{name}={redact_url(url)!r}: the path must be a database number, as in /0")
    queried = dict(parse_qsl(urlsplit(url).query)).get("db", "")  # redis-py reads it over the path, kombu never
    if database and queried.isdigit() and int(queried) != int(database):
        raise ConfigError(f"{name}={redact_url(url)!r}: its path and ?db= name different databases; give one")


def check_broker_options(name: str, url: str) -> None:
    """The options of the broker URL, as kombu's Connection reads them."""
    scheme = urlsplit(url).scheme
    amqp = scheme in ("amqp", "amqps", "pyamqp")
    rules, transport = (KOMBU_AMQP, "AMQP") if amqp else (KOMBU_SOCKET if "socket" in scheme else KOMBU_TLS, "Redis")
    _check(name, url, rules, f"kombu's {transport} transport")
    _check_certificate_named(name, url)


def _check_certificate_named(name: str, url: str) -> None:
    """A `rediss://` URL says how the server's certificate is checked. *Why:* without it Celery's result store
    raised a bare ValueError at each worker's start and each client call (exit 1), and kombu's broker checked no
    certificate (a man in the middle read the password)."""
    if urlsplit(url).scheme == "rediss" and not dict(parse_qsl(urlsplit(url).query)).get("ssl_cert_reqs"):
        raise ConfigError(
            f"{name}={redact_url(url)!r}: a rediss:// URL must say how the server's certificate is checked:"
            " add ?ssl_cert_reqs=required (with ssl_ca_certs=/path/ca.pem for a private CA)"
        )


def _check(name: str, url: str, rules: dict[str, Rule], client: str) -> None:
    for option, value in parse_qsl(urlsplit(url).query):  # a blank value is ignored by both clients
        if option not in rules:
            raise ConfigError(
                f"{name}={redact_url(url)!r}: {client} takes no option {option!r} (it takes {', '.join(sorted(rules))})"
            )
        readable, takes = rules[option]
        if not readable(value):
            raise ConfigError(f"{name}={redact_url(url)!r}: {option} must be {takes}")


def why_unreadable(value: str, err: ValueError) -> str:
    """Why the URL parser refused `value`. *Why not its words:* with a login in the URL they quote it, a password
    cut where an unencoded `#`, `?` or `/` ended the authority early (`Port could not be cast ... 'Xy3'`)."""
    if "@" not in value:
        return str(err)
    hint = "a password's '/', '?', '#', '@', ':', '%' and blanks must be percent-encoded (%2F %3F %23 %40 %3A %25 %20)"
    if str(err).startswith("Port out of range"):  # its words quote nothing: a port, or digits a password cut short
        return f"its port is out of range 0-65535 (or its password was cut short: {hint})"
    return f"its login cannot be read (the parser's words are not shown, they may quote the password): {hint}"
