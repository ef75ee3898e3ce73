"""Flower's settings for animastor-tasks, read from the ANIMASTOR_FLOWER_* environment; also Flower's `--conf` file.

`animastor-tasks flower` starts Flower with this very file as its configuration, so an installed package
(a wheel, a container) needs no file from the source tree; so does `celery -A animastor_tasks flower` run from
any directory (`guard_flower_command`, called as the app loads); the repository's `flowerconfig.py` is a shim
over it for `celery -A animastor_tasks flower --conf=flowerconfig.py`.

Why a config file and not flags: Flower shows who runs what on which GPU and can revoke tasks and shut
workers down, so it must never come up open by accident. Flower refuses to start (message on stderr,
exit status 2) unless basic auth is configured:

| variable                       | meaning                                                     | default     |
| ------------------------------ | ----------------------------------------------------------- | ----------- |
| ANIMASTOR_FLOWER_BASIC_AUTH    | `user:password` (the password may contain ':')              | (required)  |
| ANIMASTOR_FLOWER_DEV_NO_AUTH   | `1`: pages without auth, on a loopback address only (*)     | unset       |
| ANIMASTOR_FLOWER_ADDRESS       | address to listen on                                        | 127.0.0.1   |
| ANIMASTOR_FLOWER_PORT          | port to listen on                                           | 5555        |

(*) Flower's HTTP API (`/api/...`) still answers 401 then, unless Flower's own `FLOWER_UNAUTHENTICATED_API` is set.
Credentials are passed through the environment, never the command line (which `ps` shows).
Flower's own `/metrics` and `/healthcheck` answer without auth: they are internal endpoints,
keep them behind the loopback address or a private network.

Flower (Tornado) executes a config file and takes every global whose name is one of its options
(`address`, `port`, `basic_auth`, `logging`, ...): nothing here may be named like one, hence the
underscored imports.
"""

from __future__ import annotations

import ipaddress as _ipaddress
import os as _os
import socket as _socket
import sys as _sys
from collections.abc import Mapping as _Mapping
from collections.abc import Sequence as _Sequence
from typing import Any as _Any

PREFIX = "flowerconfig"


class Refused(Exception):
    """The environment does not describe a Flower we may start."""


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return _ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def flower_options(env: _Mapping[str, str]) -> dict[str, _Any]:
    """The Flower options for `env`; raises `Refused` with the reason when Flower must not start."""
    address = env.get("ANIMASTOR_FLOWER_ADDRESS", "").strip() or "127.0.0.1"
    raw_port = env.get("ANIMASTOR_FLOWER_PORT", "").strip() or "5555"
    try:
        port = int(raw_port)
    except ValueError:
        raise Refused(f"ANIMASTOR_FLOWER_PORT={raw_port!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise Refused(f"ANIMASTOR_FLOWER_PORT={raw_port!r} must be between 1 and 65535")

    if (why := _cannot_listen_on(address)) is not None:  # *Why:* Flower's own traceback (gaierror, EADDRNOTAVAIL)
        raise Refused(f"ANIMASTOR_FLOWER_ADDRESS={address!r} is no address this host can listen on: {why}")
    options: dict[str, _Any] = {"address": address, "port": port, "max_tasks": 10000}
    credentials = env.get("ANIMASTOR_FLOWER_BASIC_AUTH", "")
    if credentials.strip():
        user, sep, password = credentials.strip().partition(":")
        if not sep or not user or not password:
            # Never echo the value: it may be a password typed without its user.
            raise Refused("ANIMASTOR_FLOWER_BASIC_AUTH must be 'user:password' with a non-empty user and password")
        # A list, not a string: Flower would split a string on ',' and break passwords containing one.
        options["basic_auth"] = [f"{user}:{password}"]
        return options
    if env.get("ANIMASTOR_FLOWER_DEV_NO_AUTH", "").strip() == "1":
        if not is_loopback(address):
            raise Refused(
                f"ANIMASTOR_FLOWER_DEV_NO_AUTH=1 is allowed only on a loopback address, not {address!r}; "
                "set ANIMASTOR_FLOWER_BASIC_AUTH=user:password instead"
            )
        return options
    raise Refused(
        "Flower needs authentication: set ANIMASTOR_FLOWER_BASIC_AUTH=user:password "
        "(or ANIMASTOR_FLOWER_DEV_NO_AUTH=1 for a loopback-only development instance)"
    )


def _cannot_listen_on(address: str) -> str | None:
    """Why no socket can be bound to `address` (a free port of it, at once let go), or None."""
    try:
        found = _socket.getaddrinfo(address, 0, type=_socket.SOCK_STREAM, flags=_socket.AI_PASSIVE)
    except (OSError, UnicodeError) as err:
        return str(err)
    why = "no address"
    for family, kind, proto, _, where in found:
        with _socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(where)
                return None
            except OSError as err:
                why = str(err)
    return why


# Who can reach Flower is decided by the variables above alone: Flower reads its command line after this file,
# so `--address=0.0.0.0` there slipped an instance without auth past the loopback rule.
_GUARDED = frozenset({"address", "port", "basic_auth", "auth", "unix_socket"})
GUARDED_HERE = _GUARDED | {"conf"}  # `animastor-tasks flower`, which passes the packaged settings file itself


def refuse_guarded_flags(argv: _Sequence[str], guarded: frozenset[str] = _GUARDED) -> None:
    """Refused: a command-line option (Tornado's `--name=value` or `--name value`, with any number of leading
    dashes, as Tornado reads them) that would decide who reaches Flower instead of the ANIMASTOR_FLOWER_*
    variables."""
    found = sorted({arg.split("=", 1)[0] for arg in argv if arg.startswith("-") and _option(arg) in guarded})
    if found:
        raise Refused(
            f"{', '.join(found)} on the command line: set ANIMASTOR_FLOWER_ADDRESS, ANIMASTOR_FLOWER_PORT and "
            "ANIMASTOR_FLOWER_BASIC_AUTH instead"
        )


def _option(arg: str) -> str:
    return arg.lstrip("-").split("=", 1)[0].replace("-", "_")


def options_or_exit(env: _Mapping[str, str], argv: _Sequence[str] | None = None) -> dict[str, _Any]:
    """`flower_options(env)`, or the reason on stderr and exit status 2 (before Flower opens any port).
    `argv`: Flower's command line (this process's when None)."""
    try:
        options = flower_options(env)
        refuse_guarded_flags(_sys.argv[1:] if argv is None else argv)
    except Refused as err:
        _sys.stderr.write(f"{PREFIX}: refusing to start Flower: {err}\n")
        raise SystemExit(2) from None
    if "basic_auth" not in options:
        _sys.stderr.write(f"{PREFIX}: WARNING: Flower runs WITHOUT authentication (ANIMASTOR_FLOWER_DEV_NO_AUTH=1)\n")
    return options


def conf_path() -> str:
    """This file, for Flower's `--conf`."""
    return _os.path.abspath(__file__)


def guard_flower_command() -> None:
    """When Celery's command line loads the app for its `flower` command (`celery -A animastor_tasks flower`): the
    refusal above (stderr, exit status 2) and this file as Flower's `--conf` unless the command line names one
    (a `FLOWER_CONF` in the environment too). Called by the app as it is loaded; a no-op under any other command.
    *Why:* Flower reads `./flowerconfig.py` only when the directory it runs in has one and silently runs without
    it: from any other directory (an installed package, a container) it came up with no auth on every interface."""
    import click  # imported here: Flower executes this file as its configuration

    ctx = click.get_current_context(silent=True)
    if ctx is None or ctx.invoked_subcommand != "flower":
        return
    options_or_exit(_os.environ)
    import flower.options  # noqa: F401 - defines Flower's options, `conf` among them
    from tornado.options import options as _tornado_options

    _tornado_options.conf = conf_path()  # Flower reads its command line's `--conf` (or FLOWER_CONF) after this


if "__name__" not in globals():
    # Executed by Flower as its --conf file (Tornado runs it with no __name__): publish the options.
    globals().update(options_or_exit(_os.environ))
