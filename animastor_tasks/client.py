"""A Python client for other services: enqueue the public tasks by name, JSON only.

It needs only the broker and the result backend, not the package's workers, and
fails fast with `StoreUnavailable("broker", ...)` when the broker cannot be reached.
Results are typed with `animastor_tasks.contract` (the schemas under docs/schemas/).
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Literal, cast, overload

import redis
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
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
from animastor_tasks.domain.registry import CONTROL_QUEUE
from animastor_tasks.errors import AnimastorError, InvalidCommand, StoreUnavailable

_REMOTE_INVALID = ("InvalidCommand", "InvalidInput", "InvalidBook")


class Client:
    def __init__(self, settings: Settings | None = None, *, timeout: float = 30.0) -> None:
        self.settings = settings or Settings.from_env()
        self.timeout = timeout
        self.app = Celery(
            "animastor_client", broker=self.settings.broker_url, backend=result_backend_url(self.settings.redis_url)
        )
        self.app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            result_serializer="json",
            result_accept_content=["json"],
            broker_connection_timeout=3,
            broker_connection_retry=False,
            broker_connection_max_retries=0,
            broker_transport_options={"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5},
            # The result store is subscribed to before the publish: it must fail fast too (Celery's default
            # retries for ~20 s, then raises a bare RuntimeError).
            result_backend_transport_options={
                "retry_policy": {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
            },
        )

    def _call(self, name: str, kwargs: RegenerateKwargs | CancelKwargs | GateKwargs, wait: bool) -> Any:
        try:
            result = self.app.send_task(
                name,
                kwargs=dict(kwargs),
                queue=CONTROL_QUEUE,
                retry=True,
                retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
            )
        except (OperationalError, OSError) as err:
            raise StoreUnavailable("broker", self.settings.broker_url, str(err) or type(err).__name__) from err
        except (redis.RedisError, RuntimeError) as err:
            raise self._result_store_down(err) from err
        if not wait:
            return Enqueued(task_id=result.id)
        try:
            return result.get(timeout=self.timeout)
        except CeleryTimeout as err:
            try:  # no answer may mean the result store went away meanwhile (Celery waits out its timeout then)
                result.ready()
            except (redis.RedisError, RuntimeError) as lost:
                raise self._result_store_down(lost, sent=result.id) from err
            raise AnimastorError(
                f"{name}: no answer within {self.timeout:.0f}s; is a control worker consuming {CONTROL_QUEUE}? "
                f"(task id {result.id}: unless a worker took it, it stays queued and runs when one starts)"
            ) from err
        except (redis.RedisError, RuntimeError) as err:
            # The result store went down while the answer was awaited: the task was sent, and may have run.
            raise self._result_store_down(err, sent=result.id) from err
        except Exception as err:
            if type(err).__name__ in _REMOTE_INVALID:
                raise InvalidCommand(str(err)) from err
            raise
        finally:
            # The store may be down: the answer, or the error above, is what counts.
            with contextlib.suppress(redis.RedisError, RuntimeError):
                result.forget() if result.ready() else None

    def _result_store_down(self, err: redis.RedisError | RuntimeError, sent: str | None = None) -> Exception:
        """The Redis result store could not be reached (a RuntimeError raised from a connection error after
        Celery's reconnect attempts). With one Redis for both, that is the broker being down. Any other
        RuntimeError is returned as it is."""
        cause = err if isinstance(err, redis.RedisError) else err.__cause__
        if not isinstance(cause, redis.RedisError | OSError):
            return err
        same = self.settings.redis_url == self.settings.broker_url
        store, url = ("broker", self.settings.broker_url) if same else ("redis", self.settings.redis_url)
        after = f" after task {sent} was sent (it may still run)" if sent else ""
        return StoreUnavailable(store, url, f"result store unreachable{after}: {cause}")

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
    ) -> Enqueued: ...
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
    ) -> RegenerateResult | Enqueued:
        """One command per stage; `command_id` makes a resend a no-op (one is made if omitted).

        `priority` stays a plain string too: the control worker validates it (InvalidCommand)."""
        kwargs: RegenerateKwargs = {
            "book_id": book_id,
            "stages": _as_list(stages),
            "scenes": scenes if not isinstance(scenes, list | tuple) else [_as_list(s) for s in scenes],
            "command_id": str(uuid.uuid4()) if command_id is None else command_id,  # "" is the worker's to refuse
            "force": force,
        }
        if priority is not None:  # sent only when asked for, so older control workers still accept the call
            kwargs["priority"] = cast(PriorityName, priority)
        return cast(RegenerateResult | Enqueued, self._call("animastor.regenerate", kwargs, wait))

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
        self.app.close()


def _as_list(value: Any) -> Any:
    """A tuple sent as the list it stands for; anything else as given, for the control worker to refuse with its
    field's name. *Why:* made a list, a string was split into its characters: `scenes=("ch", "s1")` (one pair
    without its list) became the scenes [c, h] and [s, 1], a valid request for work nobody asked for."""
    return list(value) if isinstance(value, list | tuple) else value
