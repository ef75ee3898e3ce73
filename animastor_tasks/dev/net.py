"""Loopback ports and HTTP readiness for processes started locally (the demo, the tests).

Why pick ports at run time: a second demo or a parallel test run must not fail because 5555 is taken.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Mapping

from animastor_tasks.errors import ConfigError


def free_port(address: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def port_setting(env: Mapping[str, str], name: str, default: int) -> int:
    """The port in the environment variable `name`, else `default`; ConfigError when it is not a port."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ConfigError(f"{name}={raw!r} is not a port number")
    return int(raw)


def port_or_free(address: str, port: int) -> int:
    """`port` when nothing listens on it, else a free one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return free_port(address)
    return port


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """True when a GET of `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:
        return False
