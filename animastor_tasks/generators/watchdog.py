"""A request that a stop or its deadline can cut short, wherever it is blocked.

requests gives no way to interrupt a read in progress: a server still computing (no byte of its
answer yet) or one trickling its headers left a stopped job, and its GPU slot, waiting on a read
timeout. So each connection a session opens is handed to the watchdog of the request running in
that thread, and the watchdog shuts it down when the job is told to stop or the whole answer's
deadline passes: the blocked read returns at once, and a server that drops the work of a closed
connection (most inference servers do) frees its GPU too. A socket is handed over before it connects, so a
connect in progress is cut too, and so is a TLS handshake (through a duplicate of the socket's descriptor); name
resolution is not (the system's resolver cannot be interrupted).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, LocationParseError, NameResolutionError, NewConnectionError
from urllib3.util.connection import allowed_gai_family

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

    def release(self, sock: socket.socket) -> None:
        """Forget `sock` and close it, under the lock: a cut never meets its descriptor number taken by another."""
        with self._lock:
            if sock in self._sockets:
                self._sockets.remove(sock)
            sock.close()

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


def _connected(conn: HTTPConnection) -> socket.socket:
    """urllib3's `_new_conn` (its `create_connection`, its errors), each socket tried handed to the watchdog
    before it connects. *Why:* adopted once connected, a stop or the deadline waited out `connect_timeout` (up to
    600 s), once per address, against a host that drops SYNs."""
    host = conn._dns_host.strip("[]")  # the host to connect to: the proxy's, when there is one
    try:
        host.encode("idna")
    except UnicodeError:
        raise LocationParseError(f"'{host}', label empty or too long") from None
    try:
        addresses = socket.getaddrinfo(host, conn.port, allowed_gai_family(), socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise NameResolutionError(conn.host, conn, err) from err
    error: OSError = OSError("getaddrinfo returns an empty list")
    watchdog: Watchdog | None = getattr(_running, "watchdog", None)
    for family, kind, proto, _, address in addresses:
        sock = _adopted(socket.socket(family, kind, proto))
        try:
            for option in conn.socket_options or ():
                sock.setsockopt(*option)
            sock.settimeout(conn.timeout if isinstance(conn.timeout, int | float) else socket.getdefaulttimeout())
            if conn.source_address:
                sock.bind(conn.source_address)
            if watchdog is not None and watchdog.why is not None:
                # Cut already: a socket shut down before it connects still connects, and the host's next address
                # waited out its whole connect_timeout (one per address: a name with AAAA and A records has two).
                raise ConnectionAbortedError(f"request {watchdog.why}")
            sock.connect(address)
        except OSError as err:
            sock.close()
            error = err
        else:
            sys.audit("http.client.connect", conn, conn.host, conn.port)
            return sock
    if isinstance(error, TimeoutError):
        message = f"Connection to {conn.host} timed out. (connect timeout={conn.timeout})"
        raise ConnectTimeoutError(conn, message) from error
    raise NewConnectionError(conn, f"Failed to establish a new connection: {error}") from error


class _WatchedHTTPConnection(HTTPConnection):
    def _new_conn(self) -> socket.socket:
        return _connected(self)


class _WatchedHTTPSConnection(HTTPSConnection):
    _handshake_guard: tuple[Watchdog, socket.socket] | None = None

    def _new_conn(self) -> socket.socket:
        """The TCP socket, and a duplicate of its descriptor handed to the watchdog: TLS detaches the socket object
        before its handshake (cut, it does nothing), and the duplicate shuts the same connection down. *Why:* a stop
        or `total_timeout` waited out `connect_timeout` (up to 600 s) against a server that never answered the
        handshake."""
        sock = _connected(self)
        watchdog: Watchdog | None = getattr(_running, "watchdog", None)
        if watchdog is not None:
            self._handshake_guard = watchdog, sock.dup()
            watchdog.adopt(self._handshake_guard[1])
        return sock

    def connect(self) -> None:
        """And the TLS socket that takes the TCP one over, once the handshake is done; the duplicate then goes, so it
        never holds the connection open past its close."""
        try:
            super().connect()
        finally:
            if self._handshake_guard is not None:
                watchdog, duplicate = self._handshake_guard
                self._handshake_guard = None
                watchdog.release(duplicate)
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
