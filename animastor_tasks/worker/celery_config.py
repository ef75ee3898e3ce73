"""Celery settings derived from `Settings`: queues, routes, beat schedule, delivery.

GPU queues take one message at a time (prefetch 1, ack late) so a job held by a
busy worker is never stranded behind another, after a broker reconnect too (the jobs
of the lost channel keep their processes out of the new prefetch: worker/rejoin.py);
a job is stopped softly, then hard, before the broker would redeliver it (checked in
`Settings.check_time_limits`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from kombu import Exchange, Queue

from animastor_tasks.config import Settings, result_backend_url
from animastor_tasks.domain.registry import CONTROL_QUEUE, CONTROL_TASKS

# kombu's Redis transport with one client per channel (adapters/redis_broker.py); only for a plain
# `redis://` URL: other schemes keep the transport kombu picks for them.
REDIS_BROKER_TRANSPORT = "animastor_tasks.adapters.redis_broker:Transport"
BROKER_HEARTBEAT_SECONDS = 10
REDIS_HEALTH_CHECK_SECONDS = 2
REDIS_SOCKET_TIMEOUT_SECONDS = 10


def build_config(settings: Settings) -> dict[str, Any]:
    queues = [Queue(CONTROL_QUEUE, Exchange(CONTROL_QUEUE, type="direct"), routing_key=CONTROL_QUEUE)]
    routes: dict[str, dict[str, str]] = {f"animastor.{name}": {"queue": CONTROL_QUEUE} for name in CONTROL_TASKS}
    # RabbitMQ closes the channel of a delivery not acked within its consumer timeout (30 min by default), and a
    # job holds its delivery up to the hard time limit: each GPU consumer asks for the visibility timeout, which
    # outlasts it (RabbitMQ 3.12 and later honour it; earlier ones need `consumer_timeout` in rabbitmq.conf).
    ack_timeout = {"x-consumer-timeout": settings.visibility_timeout * 1000}
    for spec in settings.stages:
        queues.append(
            Queue(
                spec.queue,
                Exchange(spec.queue, type="direct"),
                routing_key=spec.queue,
                consumer_arguments=ack_timeout,
            )
        )
        routes[spec.task_name] = {"queue": spec.queue}
    return {
        "broker_url": settings.broker_url,
        "broker_transport": REDIS_BROKER_TRANSPORT if urlsplit(settings.broker_url).scheme == "redis" else None,
        "result_backend": result_backend_url(settings.redis_url),
        "result_expires": 3600,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_queues": queues,
        "task_default_queue": CONTROL_QUEUE,
        "task_routes": routes,
        "task_create_missing_queues": False,
        "worker_prefetch_multiplier": 1,
        # Redis broker: a message fetched ahead waits in the unacked set until a worker acks it; one killed
        # before it started the task left it there for the visibility timeout (an hour), so a regenerate or a
        # Stop All ran an hour late. A worker fetches only for a free process (AMQP redelivers at once).
        "worker_disable_prefetch": urlsplit(settings.broker_url).scheme.startswith("redis"),
        "task_acks_late": False,
        # Flower sees every task through worker events; a STARTED write to the result backend
        # and a task-sent event per publish would only add to each hop's latency. GPU jobs are the
        # exception: `CeleryPublisher.publish_job` sends their task-sent event itself, after the job,
        # so Flower lists a queued job as PENDING while it waits for a GPU.
        "task_track_started": False,
        "worker_send_task_events": True,
        "task_send_sent_event": False,
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        "broker_connection_timeout": 3,
        # Surviving partitions (docs/deployment.md): a worker retries a lost broker for ever, every
        # second (worker/rejoin.py), rather than backing off to 30 s and giving up after 100 tries.
        "broker_connection_max_retries": None,
        "worker_consumer": "animastor_tasks.worker.rejoin:RejoiningConsumer",
        # AMQP: the broker notices a silent (half-open) connection within about two heartbeats, so the
        # job a cut-off worker held goes back to its queue and its consumer stops being counted.
        "broker_heartbeat": BROKER_HEARTBEAT_SECONDS,
        # AMQP: a worker that rejoins while the broker still holds its old, half-open connection must be
        # able to declare its remote-control (pidbox) queue again; an exclusive one is locked by the old
        # connection (RESOURCE_LOCKED, 405) and kills the worker (celery#1963). Flower's inspect still works.
        "control_queue_exclusive": False,
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout,
            # Redis broker: a BRPOP on a silent connection is dropped and reconnected within a few seconds.
            "health_check_interval": REDIS_HEALTH_CHECK_SECONDS,
            "socket_timeout": REDIS_SOCKET_TIMEOUT_SECONDS,
            "socket_keepalive": True,
        },
        "result_backend_transport_options": {"retry_policy": {"max_retries": 2}},
        # No `expires`: Celery writes it by beat's clock and the worker judges it by its own, so a control host 10 s
        # ahead of beat's dropped every tick. Ticks piled up while no control worker ran cost one lock attempt each:
        # the first runs, the others find its singleton lock held (`liveness.PERIODIC_LOCK_SHARE`).
        "beat_schedule": {
            "animastor-tick": {
                "task": "animastor.tick",
                "schedule": timedelta(seconds=settings.tick_seconds),
                "options": {"queue": CONTROL_QUEUE},
            },
            "animastor-reconcile": {
                "task": "animastor.reconcile",
                "schedule": timedelta(seconds=settings.reconcile_seconds),
                "options": {"queue": CONTROL_QUEUE},
            },
        },
        "beat_max_loop_interval": min(5.0, settings.tick_seconds),
        # Survives a wall clock stepped back, and keeps no schedule file (`-s` is accepted, unused).
        "beat_scheduler": "animastor_tasks.worker.beat_schedule:Scheduler",
    }
