"""A Python client for other services: enqueue the public tasks by name, JSON only.

It needs only the broker and the result backend, not the package's workers, and
fails fast with `StoreUnavailable("broker", ...)` when the broker cannot be reached.
Results are typed with `animastor_tasks.contract` (the schemas under docs/schemas/).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import uuid
from typing import Any, Literal, cast, overload
from urllib.parse import urlsplit

import redis
from amqp.exceptions import AMQPError
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult
from kombu.exceptions import OperationalError

from animastor_tasks.config import Settings, result_backend_url
from animastor_tasks.contract import (
    CancelKwargs,
    CancelResult,
    Enqueued,
    GateKwargs,
    GateResult,
    PriorityName,
    RegenerateKwargs,
    RegenerateResult,
)
from animastor_tasks.domain.registry import CONTROL_ORDER, CONTROL_QUEUE, SENT_AT_HEADER
from animastor_tasks.errors import AnimastorError, InvalidCommand, StoreUnavailable

_REMOTE_INVALID = ("InvalidCommand", "InvalidInput", "InvalidBook")
#: The name the client's Redis connections give themselves (`CLIENT LIST`), the broker's and the result store's.
CLIENT_NAME = "animastor-client"


class RegenerateEnqueued(Enqueued):
    """What `regenerate(..., wait=False)` returns: the task id and the command id it was sent with, which a
    retry must pass back (`command_id=`) to be a resend rather than a second command."""

    command_id: str


class Client:
    """Safe to share across a fork (gunicorn --preload): a child that uses it makes connections of its own."""

    def __init__(self, settings: Settings | None = None, *, timeout: float = 30.0) -> None:
        self.timeout = _checked_timeout(timeout)  # before anything is read or sent
        self.settings = settings or Settings.from_env()
        self._pid = os.getpid()
        self.app = self._make_app()

    def _make_app(self) -> Celery:
        app = Celery(
            "animastor_client", broker=self.settings.broker_url, backend=result_backend_url(self.settings.redis_url)
        )
        app.conf.update(_app_conf(self.settings.broker_url, self.timeout))
        return app

    def _own_app(self) -> Celery:
        """This process's app: after a fork the parent's sockets are shared with it, and an answer one process
        reads from the shared subscription is lost to the other. The child drops them unclosed (closing would
        speak on the parent's connections) and connects anew."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self.app = self._make_app()
        return self.app

    def _call(
        self, name: str, kwargs: RegenerateKwargs | CancelKwargs | GateKwargs, wait: bool, command_id: str | None = None
    ) -> Any:
        try:
            return self._send(name, kwargs, wait, command_id)
        except AnimastorError as err:
            err.command_id = command_id
            raise

    def _order(self, app: Celery, name: str, kwargs: RegenerateKwargs | CancelKwargs | GateKwargs) -> dict[str, Any]:
        """On a Redis broker, where the command waits in the control queue (`CONTROL_ORDER`: a regenerate by its
        priority, anything else first), and for a regenerate or a Stop All when it was sent (`SENT_AT_HEADER`), by the
        broker's clock: one clock for every sender, so a Stop All and a regenerate two hosts sent compare right.
        RabbitMQ keeps the queue in order (its priorities need a queue declared with `x-max-priority`, which an
        existing queue cannot take)."""
        if not urlsplit(self.settings.broker_url).scheme.startswith("redis"):
            return {}
        wanted = (kwargs.get("priority") or "normal") if name == "animastor.regenerate" else "interactive"
        order: dict[str, Any] = {"priority": CONTROL_ORDER.get(wanted, 0) if isinstance(wanted, str) else 0}
        if name in ("animastor.regenerate", "animastor.cancel"):
            with app.pool.acquire(block=True) as conn:
                seconds, micros = conn.default_channel.client.time()
            order["headers"] = {SENT_AT_HEADER: seconds + micros / 1_000_000}
        return order

    def _send(
        self, name: str, kwargs: RegenerateKwargs | CancelKwargs | GateKwargs, wait: bool, command_id: str | None
    ) -> Any:
        try:  # refused here: kombu's EncodeError would reach the caller raw
            json.dumps(kwargs, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise InvalidCommand(f"{name}: its arguments must be JSON: {err}") from None
        app = self._own_app()
        try:
            result = app.send_task(
                name,
                kwargs=dict(kwargs),
                queue=CONTROL_QUEUE,
                **self._order(app, name, kwargs),
                retry=True,
                retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
            )
        except (OperationalError, OSError, redis.RedisError, AMQPError) as err:
            # A write that timed out may have reached the broker: the task may run. AMQPError: RabbitMQ refused the
            # login or the vhost (AccessRefused, NotAllowed), which kombu does not wrap.
            detail = f"{str(err) or type(err).__name__}{_resend(command_id)}"
            raise StoreUnavailable("broker", self.settings.broker_url, detail) from err
        except RuntimeError as err:
            raise self._result_store_down(err, command_id=command_id) from err
        if not wait:
            _let_go(app, result, answered=False)  # the caller polls it by its id
            if command_id is None:
                return Enqueued(task_id=result.id)
            return RegenerateEnqueued(task_id=result.id, command_id=command_id)
        answered = False
        try:
            answer = result.get(timeout=self.timeout)
            answered = True
            return answer
        except CeleryTimeout as err:
            try:  # no answer may mean the result store went away meanwhile (Celery waits out its timeout then)
                result.ready()
            except (redis.RedisError, RuntimeError) as lost:
                raise self._result_store_down(lost, sent=result.id, command_id=command_id) from err
            raise AnimastorError(
                f"{name}: no answer within {self.timeout:g}s; is a control worker consuming {CONTROL_QUEUE}? "
                "A busy one answers late: a whole-book command of a book of 100,000 scenes or more takes tens of"
                f" seconds, so give it a longer timeout (task id {result.id}: if no worker took it, it stays queued"
                " and runs when one starts; one that"
                f" died as it took it lost it, so see `commands` before asking again{_resend(command_id)})"
            ) from err
        except (redis.RedisError, RuntimeError) as err:
            # The result store went down while the answer was awaited: the task was sent, and may have run.
            raise self._result_store_down(err, sent=result.id, command_id=command_id) from err
        except Exception as err:
            answered = True  # the task's own error, read from its result
            if type(err).__name__ in _REMOTE_INVALID:
                raise InvalidCommand(str(err)) from err
            raise
        finally:
            _let_go(app, result, answered=answered)

    def _result_store_down(
        self, err: redis.RedisError | RuntimeError, sent: str | None = None, command_id: str | None = None
    ) -> Exception:
        """The Redis result store could not be reached (a RuntimeError raised from a connection error after
        Celery's reconnect attempts). With one Redis for both, that is the broker being down. Any other
        RuntimeError is returned as it is."""
        cause = err if isinstance(err, redis.RedisError) else err.__cause__
        if not isinstance(cause, redis.RedisError | OSError):
            return err
        same = self.settings.redis_url == self.settings.broker_url
        store, url = ("broker", self.settings.broker_url) if same else ("redis", self.settings.redis_url)
        after = f" after task {sent} was sent (it may still run)" if sent else ""
        return StoreUnavailable(store, url, f"result store unreachable{after}: {cause}{_resend(command_id)}")

    @overload
    def regenerate(
        self,
        book_id: str,
        stages: list[str],
        scenes: list[tuple[str, str]] | None = ...,
        *,
        command_id: str | None = ...,
        force: bool = ...,
        priority: PriorityName | str | None = ...,
        wait: Literal[True] = ...,
    ) -> RegenerateResult: ...
    @overload
    def regenerate(
        self,
        book_id: str,
        stages: list[str],
        scenes: list[tuple[str, str]] | None = ...,
        *,
        command_id: str | None = ...,
        force: bool = ...,
        priority: PriorityName | str | None = ...,
        wait: Literal[False],
    ) -> RegenerateEnqueued: ...
    def regenerate(
        self,
        book_id: str,
        stages: list[str],
        scenes: list[tuple[str, str]] | None = None,
        *,
        command_id: str | None = None,
        force: bool = True,
        priority: PriorityName | str | None = None,
        wait: bool = True,
    ) -> RegenerateResult | RegenerateEnqueued:
        """One command per stage; `command_id` makes a resend a no-op (one is made if omitted).

        The id sent is in the `wait=False` answer and in the message of an error after which the command may
        still run (no answer in time, a store lost mid-call): a retry must pass it back, or it is a second command
        (with force, one that stops the first one's jobs). `priority` stays a plain string too: the control worker
        validates it (InvalidCommand)."""
        sent_id = str(uuid.uuid4()) if command_id is None else command_id  # "" is the worker's to refuse
        kwargs: RegenerateKwargs = {
            "book_id": book_id,
            "stages": _as_list(stages),
            "scenes": scenes if not isinstance(scenes, list | tuple) else [_as_list(s) for s in scenes],
            "command_id": sent_id,
            "force": force,
        }
        if priority is not None:  # sent only when asked for, so older control workers still accept the call
            kwargs["priority"] = cast(PriorityName, priority)
        return cast(RegenerateResult | RegenerateEnqueued, self._call("animastor.regenerate", kwargs, wait, sent_id))

    @overload
    def cancel(self, book_id: str, reason: str | None = ..., *, wait: Literal[True] = ...) -> CancelResult: ...
    @overload
    def cancel(self, book_id: str, reason: str | None = ..., *, wait: Literal[False]) -> Enqueued: ...
    def cancel(self, book_id: str, reason: str | None = None, *, wait: bool = True) -> CancelResult | Enqueued:
        """Stop All for a book; idempotent."""
        kwargs: CancelKwargs = {"book_id": book_id, "reason": reason}
        return cast(CancelResult | Enqueued, self._call("animastor.cancel", kwargs, wait))

    @overload
    def gate(self, book_id: str, lane: str | None = ..., *, wait: Literal[True] = ...) -> GateResult: ...
    @overload
    def gate(self, book_id: str, lane: str | None = ..., *, wait: Literal[False]) -> Enqueued: ...
    def gate(self, book_id: str, lane: str | None = None, *, wait: bool = True) -> GateResult | Enqueued:
        """One gate pass now (it creates no work): for callers that want a book looked at without
        waiting for the next tick."""
        kwargs: GateKwargs = {"book_id": book_id, "lane": lane}
        return cast(GateResult | Enqueued, self._call("animastor.gate", kwargs, wait))

    def close(self) -> None:
        """Closes the result store's connections, which `app.close()` leaves open (one more per client)."""
        app = self._own_app()
        backend = app._local.__dict__.get("backend")  # made on first use, per thread: never made here to close it
        try:
            if backend is not None:
                with contextlib.suppress(redis.RedisError, RuntimeError, OSError):
                    backend.result_consumer.stop()
                backend.client.connection_pool.disconnect()
        finally:
            # The broker's connections are kombu's, pooled per URL for every client of this process (reused, not
            # leaked): closing them would break the others.
            app.close()


#: The longest `timeout` a client takes, as the CLI's `--timeout`: a day. Past some 1e9 s the socket timeouts
#: overflow, and no caller waits for an answer that long.
MAX_TIMEOUT = 86_400.0


def _checked_timeout(timeout: object) -> float:
    """The client's `timeout`, a number of seconds above 0 and at most a day. *Why:* 0 or -1 published the task
    and then said "no answer within 0s" of a command that ran, `inf` was a raw OverflowError, "5" a TypeError."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout: must be a number of seconds, got {type(timeout).__name__} {timeout!r}")
    try:
        seconds = float(timeout)
    except OverflowError:  # an int past a float's range: longer than a day too
        seconds = math.inf
    if not 0 < seconds <= MAX_TIMEOUT:  # nan fails both
        raise ValueError(f"timeout: must be above 0 and at most {MAX_TIMEOUT:,.0f} seconds, got {timeout!r}")
    return seconds


def _app_conf(broker_url: str, timeout: float) -> dict[str, Any]:
    """Every wait bounded by the caller's timeout: kombu's Redis transport sets no socket timeout of its own
    (`broker_connection_timeout` is not read by it) and Celery's result store waits 120 s per read, so a silent
    or stopped Redis held a call for minutes. A subscribe to the result store is tried twice at most (hence half the
    timeout each); a publish three times: once, then twice to connect again, which kombu's `ensure` makes at least
    two (hence a third). *Why the third:* with half, a Redis broker that stopped answering held a publish 1.5 times
    the timeout."""
    each = max(0.5, timeout / 2)
    publish = max(0.5, timeout / 3)
    if urlsplit(broker_url).scheme.startswith("redis"):
        transport: dict[str, Any] = {
            "socket_timeout": publish,
            "socket_connect_timeout": publish,
            "client_name": CLIENT_NAME,
        }
    else:  # AMQP: a silent broker is noticed by a read or write timing out, a lost publish by its confirm
        transport = {"read_timeout": publish, "write_timeout": publish, "confirm_publish": True}
    return {
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_serializer": "json",
        "result_accept_content": ["json"],
        "broker_connection_timeout": min(3.0, publish),
        "broker_connection_retry": False,
        "broker_connection_max_retries": 0,
        "broker_transport_options": {
            "max_retries": 1,
            "interval_start": 0,
            "interval_step": 0.2,
            "interval_max": 0.5,
            **transport,
        },
        "redis_socket_timeout": each,
        "redis_socket_connect_timeout": each,
        "redis_client_name": CLIENT_NAME,
        # The result store is subscribed to before the publish: it must fail fast too (Celery's default
        # retries for ~20 s, then raises a bare RuntimeError). A failed subscribe is tried again once by Celery's
        # reconnect, whose policy this is: no retry of its own. *Why:* with one (`max_retries` 1), a silent Redis
        # held the call three halves of its timeout, the reconnect's two tries after the subscribe's.
        "result_backend_transport_options": {"retry_policy": {"max_retries": 0}},
    }


def _resend(command_id: str | None) -> str:
    """What an error after which the command may still run says about retrying it."""
    return f"; to ask again, resend with command_id={command_id}, not a new one" if command_id is not None else ""


def _let_go(app: Celery, result: AsyncResult, *, answered: bool) -> None:
    """Stop waiting for `result`: its subscription and its place among the backend's pending results stayed until
    the task finished (for ever, for one never run). An answer read is deleted; one not read expires in the store.
    The store may be down: the answer, or the error raised, is what counts."""
    with contextlib.suppress(redis.RedisError, RuntimeError, OSError):
        if answered:
            result.forget()
        app.backend.remove_pending_result(result)
        app.backend.result_consumer.cancel_for(result.id)


def _as_list(value: Any) -> Any:
    """A tuple sent as the list it stands for; anything else as given, for the control worker to refuse with its
    field's name. *Why:* made a list, a string was split into its characters: `scenes=("ch", "s1")` (one pair
    without its list) became the scenes [c, h] and [s, 1], a valid request for work nobody asked for."""
    return list(value) if isinstance(value, list | tuple) else value
