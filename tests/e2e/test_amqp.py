"""The same end-to-end flows on RabbitMQ, where the broker's own consumer count is used as well."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from tests.support import missing

from .harness import AmqpQueueTap, amqp_queue_depth, audio_stage, stage_table
from .test_blocked import run_blocked
from .test_full_run import run_full_book
from .test_workers import run_replaced_worker

pytestmark = [pytest.mark.e2e, pytest.mark.amqp]


def test_blocked_without_image_worker_amqp(make_stack, figure, amqp_broker) -> None:
    stack = make_stack(broker_url=amqp_broker.url)
    assert stack.settings.broker_is_amqp
    peak: dict[str, int] = {}

    def depth(queue: str) -> int:
        peak[queue] = max(peak.get(queue, 0), amqp_queue_depth(amqp_broker.url, queue) or 0)
        return peak[queue]

    if not amqp_broker.private:  # no firehose on the shared vhost: the queue depth and the journal only
        run_blocked(stack, figure, "amqp broker (shared vhost)", None, depth)
        return
    tap = AmqpQueueTap(amqp_broker.url, amqp_broker.vhost, ["gpu.audio", "gpu.image"])

    def pushes(queue: str) -> int:
        time.sleep(0.2)
        return tap.pushes(queue)

    try:
        run_blocked(stack, figure, "amqp broker", pushes, depth)
    finally:
        tap.close()


def test_full_book_run_amqp(make_stack, figure, amqp_broker) -> None:
    stack = make_stack(broker_url=amqp_broker.url)
    run_full_book(stack, figure, "amqp broker")
    # Every job was routed through RabbitMQ and consumed: nothing is left in the GPU queues.
    assert amqp_queue_depth(amqp_broker.url, "gpu.audio") == 0
    assert amqp_queue_depth(amqp_broker.url, "gpu.image") == 0


def test_a_stage_whose_only_worker_is_replaced_keeps_its_commands_amqp(make_stack, figure, amqp_broker) -> None:
    """Warm shutdown cancels the consumer before the pool has finished its job, and RabbitMQ counts the queue's
    consumers 0 from then on, while the draining worker still beats: the broker's zero won over the live heartbeat,
    the job's own refill (or the tick) found the stage without a consumer and no departure noted, and BLOCKED its
    command for good."""
    stages = stage_table(audio=audio_stage(params={"steps": 24, "step_seconds": 0.25}))  # 6 s: a tick drains with it
    run_replaced_worker(make_stack(broker_url=amqp_broker.url, stages=stages), figure, " (amqp broker)", scenes=2)


def test_a_gpu_worker_asks_rabbitmq_for_an_ack_timeout_longer_than_its_jobs(make_stack, figure, amqp_broker) -> None:
    """RabbitMQ closes the channel of a delivery not acked within its `consumer_timeout` (30 min by default), and
    a job may hold its delivery up to the hard time limit (31 min 40 s by default): such a job's worker lost its
    channel, every job it held went back to the queue, and Celery logged an unrecoverable error. Each GPU
    consumer now asks for the visibility timeout (`x-consumer-timeout`, honoured from RabbitMQ 3.12)."""
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        missing("rabbitmqctl is not installed")
    stack = make_stack(broker_url=amqp_broker.url, visibility_timeout=5000)
    stack.cluster.wait_ready(stack.cluster.gpu("audio", wait=False))
    listed = subprocess.run(
        [ctl, "list_consumers", "-p", amqp_broker.vhost, "queue_name", "arguments"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    [row] = [line for line in listed.splitlines() if line.startswith("gpu.audio\t")]
    assert '{"x-consumer-timeout",5000000}' in row, listed
    figure(f"gpu.audio consumer: {row}")
