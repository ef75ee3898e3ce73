"""A read that overlaps the caller's own work: the next page of a big book while this one is decided,
a book's Redis snapshot while its Postgres rows come back.

One reader thread per process, made on first use in that process: a Celery pool process forked from
a parent that had one makes its own (a thread does not survive a fork).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
_lock = threading.Lock()
_reader: tuple[int, ThreadPoolExecutor] | None = None


def submit(read: Callable[[], T]) -> Future[T]:
    """Run `read` on the process's reader thread; its result (or its error) from `.result()`.
    A read must not itself wait for another read: there is one reader."""
    global _reader
    with _lock:
        if _reader is None or _reader[0] != os.getpid():
            _reader = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="animastor-read-ahead"))
        reader = _reader[1]
    return reader.submit(read)
