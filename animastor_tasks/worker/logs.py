"""Logging of the Celery processes (workers, beat): their level, their format and the job each line belongs to.

Why: Celery logs at WARNING unless `-l` says otherwise, which hides the `[GENERATE]` and `[WORKER]` lines
operators rely on. Here the level is the command line's `-l` when one was given, else `ANIMASTOR_LOG_LEVEL`,
else INFO; `ANIMASTOR_LOG_FORMAT=json` writes one JSON object per line; and every line a task logs carries
what it works on (book, chapter, scene, stage, command_id, dispatch_id), set around each task from its kwargs
by the Celery signals below, so the tasks themselves stay thin.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from celery import signals
from pythonjsonlogger.json import JsonFormatter

from animastor_tasks.domain.book import storable
from animastor_tasks.errors import ConfigError
from animastor_tasks.flow.job import is_beside_the_job

LEVEL_VAR = "ANIMASTOR_LOG_LEVEL"
FORMAT_VAR = "ANIMASTOR_LOG_FORMAT"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")

_context: contextvars.ContextVar[_Context | None] = contextvars.ContextVar("animastor_log", default=None)
_running: dict[str, _Context] = {}  # task id -> its context, in this process
_tokens: dict[str, contextvars.Token[_Context | None]] = {}
_lock = threading.Lock()
_TAG = re.compile(r"\[([A-Z][A-Z0-9-]*)\]")
_HOST = socket.gethostname()


def level_from_env(env: Mapping[str, str]) -> str:
    """`ANIMASTOR_LOG_LEVEL` (a level name), INFO when unset; a bad value is a `ConfigError` naming it."""
    raw = env.get(LEVEL_VAR, "").strip()
    if not raw:
        return "INFO"
    if raw.upper() not in LEVELS:
        raise ConfigError(f"{LEVEL_VAR}={raw!r} must be one of {', '.join(LEVELS)}")
    return raw.upper()


def format_from_env(env: Mapping[str, str]) -> str:
    """`ANIMASTOR_LOG_FORMAT`: `text` (Celery's lines, the default) or `json` (one object per line)."""
    raw = env.get(FORMAT_VAR, "").strip().lower() or "text"
    if raw not in FORMATS:
        raise ConfigError(f"{FORMAT_VAR}={raw!r} must be one of {', '.join(FORMATS)}")
    return raw


def level_given(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """True when the Celery command line (or Celery's own CELERY_<COMMAND>_LOGLEVEL) chose the level."""
    if env.get("CELERY_WORKER_LOGLEVEL") or env.get("CELERY_BEAT_LOGLEVEL"):
        return True
    return any(a in ("-l", "--loglevel") or a.startswith("--loglevel=") or re.fullmatch(r"-l\w+", a) for a in argv)


def effective_level(celery_level: int | str | None, argv: Sequence[str], env: Mapping[str, str]) -> int:
    """The level a process logs at: `-l` when given, else ANIMASTOR_LOG_LEVEL, else INFO."""
    if celery_level is not None and level_given(argv, env):
        return celery_level if isinstance(celery_level, int) else logging.getLevelName(str(celery_level).upper())
    return int(logging.getLevelName(level_from_env(env)))


# -- the job context ---------------------------------------------------------------------------------------------


def current_context() -> dict[str, str]:
    """What the line being logged works on: the running task's context in its own thread; in another thread
    (a job's lease watcher) the one task this process runs, when it runs exactly one (prefork: always)."""
    if is_beside_the_job():
        return {}
    found = _context.get()
    if found is None:
        with _lock:
            found = next(iter(_running.values())) if len(_running) == 1 else None
    return found.fields() if found is not None else {}


def task_context(kwargs: Mapping[str, Any]) -> dict[str, str]:
    """The context of one of our tasks, from its kwargs (`animastor.regenerate`: the caller's command_id)."""
    ctx: dict[str, str] = {}
    for field, key in (
        ("book", "book_id"),
        ("chapter", "chapter_id"),
        ("scene", "scene_id"),
        ("stage", "stage"),
        ("command_id", "command_id"),
        ("dispatch_id", "dispatch_id"),
    ):
        value = kwargs.get(key)
        if isinstance(value, str) and value:
            ctx[field] = value
    return ctx


class _Context:
    """One task's context. A GPU job's command_id is looked up when its first line is written (after the job's
    start checks: it costs the start nothing), once, by whichever thread writes that line."""

    def __init__(self, fields: dict[str, str], *, find_command: bool = False) -> None:
        self._fields, self._find_command = fields, find_command
        self._lock = threading.Lock()

    def fields(self) -> dict[str, str]:
        if not self._find_command or threading.current_thread().name == _Lookup.THREAD:
            return self._fields
        with self._lock:
            if self._find_command:
                command = _Lookup.command_of(self._fields)
                if command:
                    self._fields = {**self._fields, "command_id": command}
                self._find_command = False
        return self._fields


class _Lookup:
    """The newest command (active first) that targets a GPU job's pair: the command the job works for.

    Why in a thread of its own: a log line must never wait long for it. It is given `TIMEOUT`; after one
    that did not answer in time (Postgres down) none is tried for `COOLDOWN` seconds.
    """

    SQL = (
        "SELECT c.command_id::text FROM command_targets t JOIN commands c USING (command_id)"
        " WHERE t.book_id = %s AND t.chapter_id = %s AND t.scene_id = %s AND t.stage = %s"
        " ORDER BY (c.status = 'active') DESC, c.created_at DESC LIMIT 1"
    )
    THREAD = "animastor-log-command"
    TIMEOUT = 1.0
    COOLDOWN = 30.0
    failed_at = -COOLDOWN

    @classmethod
    def command_of(cls, fields: Mapping[str, str]) -> str | None:
        if time.monotonic() - cls.failed_at < cls.COOLDOWN:
            return None
        pair = (fields.get("book", ""), fields.get("chapter", ""), fields.get("scene", ""), fields.get("stage", ""))
        found: list[str] = []
        thread = threading.Thread(target=cls._query, args=(pair, found), name=cls.THREAD, daemon=True)
        thread.start()
        thread.join(cls.TIMEOUT)
        if thread.is_alive():
            cls.failed_at = time.monotonic()
            return None
        return found[0] if found else None

    @classmethod
    def _query(cls, pair: tuple[str, str, str, str], found: list[str]) -> None:
        from animastor_tasks.worker import wiring

        try:
            with wiring.current().db.read() as conn:
                row = conn.execute(cls.SQL, pair).fetchone()
        except Exception:  # no command known: the job's lines go without one
            return
        if row is not None:
            found.append(str(row[0]))


def on_task_prerun(task_id: str | None = None, task: Any = None, kwargs: Any = None, **_: Any) -> None:
    name = str(getattr(task, "name", "") or "")
    if not task_id or not name.startswith("animastor."):
        return
    fields = task_context(kwargs if isinstance(kwargs, Mapping) else {})
    ctx = _Context(fields, find_command=name.startswith("animastor.generate.") and "command_id" not in fields)
    with _lock:
        _running[task_id] = ctx
    _tokens[task_id] = _context.set(ctx)


@contextlib.contextmanager
def job_context(task_id: str, kwargs: Mapping[str, Any]) -> Iterator[None]:
    """The lines of a job run inside another job's task (a kept job, worker/chain.py), its lease watcher's too, carry
    that job's own fields. *Why:* they carried the first job's, set from the task's kwargs: a search of the logs by
    `dispatch_id`, `command_id` or book gave another job's lines, in another book."""
    ctx = _Context(task_context(kwargs), find_command="command_id" not in kwargs)
    with _lock:
        before = _running.get(task_id)
        _running[task_id] = ctx
    token = _context.set(ctx)
    try:
        yield
    finally:
        _context.reset(token)
        with _lock:
            if before is None:
                _running.pop(task_id, None)
            else:
                _running[task_id] = before


def on_task_postrun(task_id: str | None = None, **_: Any) -> None:
    if not task_id:
        return
    with _lock:
        _running.pop(task_id, None)
    token = _tokens.pop(task_id, None)
    if token is not None:
        try:
            _context.reset(token)
        except ValueError:  # set in another context (a pool that moved the task): just clear it
            _context.set(None)


# -- formats -------------------------------------------------------------------------------------------------------


def component_of(record: logging.LogRecord, message: str) -> str:
    """The `[COMPONENT]` a line starts with (GENERATE, WORKER, ...), else its logger's name."""
    found = _TAG.match(message)
    return found.group(1) if found else record.name


class JsonLines(JsonFormatter):
    """One JSON object per line: time, level, component, message, the job context where known, and where."""

    def __init__(self) -> None:
        super().__init__("%(message)s")  # ASCII only (the default): no id can split a line (U+2028)

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        message = record.getMessage()
        log_data["time"] = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        log_data["level"] = record.levelname
        log_data["component"] = component_of(record, message)
        super().add_fields(log_data, record, message_dict)
        log_data["logger"] = record.name
        for key, value in current_context().items():
            log_data.setdefault(key, value)
        log_data["host"] = _HOST
        log_data["process"] = record.processName
        log_data["pid"] = record.process

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        """Text from outside (an exception's message) cleaned as the text lines are: an escaped lone surrogate is
        JSON that strict readers refuse."""
        return {key: storable(value) if isinstance(value, str) else value for key, value in log_data.items()}


class WithCommand(logging.Formatter):
    """Celery's text line with ` command_id=<id>` after it when the line belongs to a command's work, and no NUL
    or lone surrogate in it."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        # Cleaned: a lone surrogate in an exception's text made a UTF-8 log file refuse the whole line.
        text = storable(self.inner.format(record))
        command = current_context().get("command_id")
        if not command:
            return text
        first, newline, rest = text.partition("\n")
        return f"{first} command_id={command}{newline}{rest}"


# -- Celery's logging signals -------------------------------------------------------------------------------------


class LogSetup:
    """The receivers of Celery's logging signals for one process, from its environment."""

    def __init__(self, env: Mapping[str, str], argv: Sequence[str]) -> None:
        self.env, self.argv = dict(env), list(argv)
        self.format = format_from_env(env)
        level_from_env(env)  # a bad value stops the process at start-up, naming the variable

    @classmethod
    def from_env(cls) -> LogSetup:
        return cls(os.environ, sys.argv)

    def level(self, celery_level: int | str | None) -> int:
        return effective_level(celery_level, self.argv, self.env)

    def connect(self) -> None:
        """Hook this process's logging set-up, and the job context around every task of ours."""
        signals.task_prerun.connect(on_task_prerun, weak=False)
        signals.task_postrun.connect(on_task_postrun, weak=False)
        if self.format == "json":
            # JSON from the first line on: a warning Celery gives before its logging set-up (running as
            # root, say) goes through this handler too, until `setup_json` puts the final one in place.
            root = logging.getLogger()
            if not root.handlers:
                root.addHandler(self.json_handler(None))
            logging.captureWarnings(True)
            # A receiver here means Celery leaves logging to us.
            signals.setup_logging.connect(self.setup_json, weak=False)
            signals.celeryd_after_setup.connect(self.json_only, weak=False)
        else:
            signals.after_setup_logger.connect(self.adjust, weak=False)
            signals.after_setup_task_logger.connect(self.adjust, weak=False)

    @staticmethod
    def json_handler(logfile: str | None) -> logging.Handler:
        handler: logging.Handler = logging.FileHandler(logfile) if logfile else logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLines())
        return handler

    def setup_json(self, loglevel: int | str | None = None, logfile: str | None = None, **_: Any) -> None:
        root = logging.getLogger()
        root.handlers = [self.json_handler(logfile)]
        root.setLevel(self.level(loglevel))

    def adjust(self, logger: logging.Logger, loglevel: int | str | None = None, **_: Any) -> None:
        """After Celery set up `logger` (text): our level, and the command_id on the lines of a command's work."""
        logger.setLevel(self.level(loglevel))
        for handler in logger.handlers:
            if not isinstance(handler.formatter, WithCommand):
                handler.setFormatter(WithCommand(handler.formatter))

    def json_only(self, instance: Any = None, **_: Any) -> None:
        """JSON lines only: no start banner, and the notices Celery prints itself (`worker: Warm shutdown
        (MainProcess)`, from its signal handlers) written as JSON objects."""
        if instance is not None:
            instance.quiet = True
        module: Any = sys.modules.get("celery.apps.worker")
        if module is not None and hasattr(module, "safe_say"):
            module.safe_say = say_json


def say_json(msg: str, f: Any = sys.__stderr__) -> None:
    """Celery's `safe_say` as one JSON line: a single os.write, no lock, so it is safe in a signal handler."""
    line = {
        "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "level": "WARNING",
        "component": "WORKER",
        "message": str(msg),
        "logger": "celery.apps.worker",
        "host": _HOST,
        "pid": os.getpid(),
    }
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.write(f.fileno(), (json.dumps(line) + "\n").encode())
