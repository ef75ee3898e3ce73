"""A loopback TCP proxy that a test can cut and restore: a server's outage, as its clients see it, for a
server the test must not stop (the machine's RabbitMQ serves other runs too).

`cut()` resets every connection through it and stops listening (a new connection is refused); `restore()`
listens again on the same port.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from types import TracebackType
from typing import Self


class TcpProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="tcp-proxy", daemon=True).start()
        return self

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._open = self._open, set()
        if listener is not None:
            _close(listener)
        for sock in sockets:  # a reset, as a peer that went away leaves it
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            _close(sock)

    def restore(self) -> None:
        if self._listener is None:
            self.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:
                    _close(client)
                    _close(upstream)
                    return
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.cut()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


class FreezingProxy(TcpProxy):
    """A proxy that, once frozen, swallows what either side sends: a server stopped (SIGSTOP) mid-connection, a hung
    proxy or pooler; what is sent is acknowledged, and nothing comes back."""

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(target)
        self.frozen = threading.Event()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not self.frozen.is_set():
                    sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)
