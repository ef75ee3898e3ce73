"""A request that a stop or its deadline can cut short, wherever it is blocked.

requests gives no way to interrupt a read in progress: a server still computing (no byte of its
answer yet) or one trickling its headers left a stopped job, and its GPU slot, waiting on a read
timeout. So each connection a session opens is handed to the watchdog of the request running in
that thread, and the watchdog shuts it down when the job is told to stop or the whole answer's
deadline passes: the blocked read returns at once, and a server that drops the work of a closed
connection (most inference servers do) frees its GPU too.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

POLL_SECONDS = 0.05  # how soon a stop or the deadline cuts the connection
_running = threading.local()  # the watchdog of the request this thread is sending, if any


class Watchdog:
    """Watches one attempt: `why` says what cut it ("stopped" or "deadline"), or is None."""

    def __init__(self, should_stop: Callable[[], bool], deadline: float) -> None:
        self._should_stop = should_stop
        self._deadline = deadline
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="request-watchdog", daemon=True)
        self.why: str | None = None

    def __enter__(self) -> Watchdog:
        _running.watchdog = self
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        _running.watchdog = None
        self._done.set()
        self._thread.join()

    def adopt(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.why is not None:
                _shut(sock)

    def _watch(self) -> None:
        while not self._done.wait(POLL_SECONDS):
            if self._should_stop():
                self._cut("stopped")
                return
            if time.monotonic() > self._deadline:
                self._cut("deadline")
                return

    def _cut(self, why: str) -> None:
        with self._lock:
            self.why = why
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    """The socket's own shutdown, a TLS one's included: `SSLSocket.shutdown` would also drop its TLS state under
    the thread reading from it."""
    with contextlib.suppress(OSError):  # closed already
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _adopted(sock: socket.socket) -> socket.socket:
    watchdog: Watchdog | None = getattr(_running, "watchdog", None)
    if watchdog is not None:
        watchdog.adopt(sock)
    return sock


class _WatchedHTTPConnection(HTTPConnection):
    def _new_conn(self) -> socket.socket:
        return _adopted(super()._new_conn())


class _WatchedHTTPSConnection(HTTPSConnection):
    def _new_conn(self) -> socket.socket:  # the TCP socket, while the TLS handshake runs on it
        return _adopted(super()._new_conn())

    def connect(self) -> None:
        """And the TLS socket that takes the TCP one over (the TCP socket object is detached by then: cut, it
        would do nothing)."""
        super().connect()
        _adopted(self.sock)


class _WatchedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


_WATCHED_POOLS = {"http": _WatchedHTTPPool, "https": _WatchedHTTPSPool}


class _WatchedAdapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _WATCHED_POOLS

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        manager.pool_classes_by_scheme = _WATCHED_POOLS
        return manager


def watched_session() -> requests.Session:
    """A session whose connections the running thread's watchdog can cut."""
    session = requests.Session()
    adapter = _WatchedAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session
