"""End-to-end helpers: stage tables, taps on the broker, a watch on asset states, and the scenarios that
tests/e2e and tests/faults share.

The processes themselves (`Stack`, `Cluster`, the private redis-server) are in tests/support, on the one
`Supervisor` of animastor_tasks.dev.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tests.support import wait_for
from tests.support.cluster import Proc
from tests.support.stack import Stack


def stage_table(**stages: Mapping[str, Any]) -> str:
    """ANIMASTOR_STAGES JSON; each keyword is a stage with its entry (queue defaults to gpu.<name>)."""
    return json.dumps({name: {"queue": f"gpu.{name}", **entry} for name, entry in stages.items()})


def audio_stage(**entry: Any) -> dict[str, Any]:
    return {"input": "text", "media_type": "audio/wav", "lease_ttl": 4, "params": {"steps": 2}, **entry}


def image_stage(**entry: Any) -> dict[str, Any]:
    return {"input": "prompt", "media_type": "image/png", "lease_ttl": 4, "params": {"steps": 2}, **entry}


# ---------------------------------------------------------------------------------------------------------------
# Watching the broker and the asset states while a test runs.


class RedisQueueTap:
    """Every push onto a Redis-broker queue, seen through keyspace notifications (our private server).

    Kombu's Redis transport publishes with LPUSH onto a list named after the queue (and
    `<queue>\\x06\\x16<n>` for priorities), so a psubscribe on the keyspace channel sees
    each publish, even one consumed before anyone could look at the list's length.
    """

    def __init__(self, url: str, queues: Sequence[str]) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.client.config_set("notify-keyspace-events", "Kl")
        db = self.client.connection_pool.connection_kwargs.get("db", 0)
        self.queues = list(queues)
        self.pushes: dict[str, int] = dict.fromkeys(self.queues, 0)
        self.push_times: list[tuple[float, str]] = []  # (time.monotonic() when seen, queue) per push
        self.max_len: dict[str, int] = dict.fromkeys(self.queues, 0)
        self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self._prefix = f"__keyspace@{db}__:"
        self._pubsub.psubscribe(*(f"{self._prefix}{q}*" for q in self.queues))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="queue-tap", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.05)
            while message is not None:
                channel = message["channel"].decode("utf-8", "replace")[len(self._prefix) :]
                if message["data"] in (b"lpush", b"rpush"):
                    for queue in self.queues:
                        if channel == queue or channel.startswith(queue + "\x06\x16"):
                            self.pushes[queue] += 1
                            self.push_times.append((time.monotonic(), queue))
                message = self._pubsub.get_message(timeout=0)
            for queue in self.queues:
                self.max_len[queue] = max(self.max_len[queue], int(self.client.llen(queue)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pubsub.close()
        self.client.close()


class AmqpQueueTap:
    """Every message published in a (private) vhost, per target queue, seen through RabbitMQ's firehose.

    Celery publishes to a direct queue through the default exchange (routing key = queue
    name), so a queue bound beside it would see nothing; the firehose (`rabbitmqctl
    trace_on`) copies every publish to `amq.rabbitmq.trace` with the routing keys in its
    headers, and a queue bound there counts them, including those consumed at once.
    """

    def __init__(self, url: str, vhost: str, queues: Sequence[str]) -> None:
        from kombu import Connection, Exchange, Queue

        self.vhost = vhost
        subprocess.run(["rabbitmqctl", "trace_on", "-p", vhost], check=True, capture_output=True, timeout=30)
        self.conn = Connection(url, connect_timeout=3)
        self.channel = self.conn.channel()
        trace = Exchange("amq.rabbitmq.trace", type="topic", durable=True, internal=True, passive=True)
        self.tap = Queue(f"e2e-firehose-{uuid.uuid4().hex[:6]}", trace, routing_key="publish.#", durable=False)
        self.tap(self.channel).declare()
        self.counts: dict[str, int] = dict.fromkeys(queues, 0)

    def pushes(self, queue: str) -> int:
        while True:
            message = self.channel.basic_get(self.tap.name, no_ack=True)
            if message is None:
                break
            headers = message.headers or message.properties.get("application_headers") or {}
            for key in headers.get("routing_keys", []):
                key = key.decode() if isinstance(key, bytes) else key
                if key in self.counts:
                    self.counts[key] += 1
        return self.counts[queue]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.tap(self.channel).delete()
        self.conn.close()
        subprocess.run(["rabbitmqctl", "trace_off", "-p", self.vhost], capture_output=True, timeout=30)


def amqp_queue_depth(url: str, queue: str) -> int | None:
    """Messages ready in an AMQP queue; None when the queue does not exist."""
    from kombu import Connection

    with Connection(url, connect_timeout=3) as conn:
        channel = conn.channel()
        try:
            _, count, _ = channel.queue_declare(queue=queue, passive=True)
            return int(count)
        except Exception:
            return None


class GeneratingMonitor:
    """Polls asset states; records how long each (pair, token) stayed `generating`."""

    def __init__(self, stack: Stack, book: str, interval: float = 0.1) -> None:
        self.stack, self.book, self.interval = stack, book, interval
        self.first: dict[tuple[tuple[str, str, str], int], float] = {}
        self.last: dict[tuple[tuple[str, str, str], int], float] = {}
        self.ended: dict[tuple[tuple[str, str, str], int], float] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="generating-monitor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from animastor_tasks.adapters.postgres.pool import Database

        db = Database(self.stack.settings.database_url, max_size=1)
        try:
            while not self._stop.is_set():
                try:
                    with db.transaction() as conn:
                        rows = conn.execute(
                            "SELECT chapter_id, scene_id, stage, fencing_token FROM asset_states"
                            " WHERE book_id = %s AND state = 'generating'",
                            (self.book,),
                        ).fetchall()
                except Exception as err:  # recorded and reported by the test
                    self.errors.append(repr(err))
                    rows = []
                now = time.monotonic()
                seen = {((c, s, st), int(t)) for c, s, st, t in rows}
                for key in seen:
                    self.first.setdefault(key, now)
                    self.last[key] = now
                for key in set(self.first) - seen - set(self.ended):
                    self.ended[key] = now
                self._stop.wait(self.interval)
        finally:
            db.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def span(self, key: tuple[tuple[str, str, str], int]) -> float:
        return self.ended.get(key, time.monotonic()) - self.first[key]

    def longest(self) -> tuple[float, Any]:
        if not self.first:
            return 0.0, None
        key = max(self.first, key=self.span)
        return self.span(key), key


def generate_lines(proc: Proc, dispatch_id: str) -> list[str]:
    return [line for line in proc.log().splitlines() if f"dispatch={dispatch_id}" in line or f"[{dispatch_id}]" in line]


FROZEN_SETTLE = 0.2  # seconds between freezing a worker and reading whether its job committed


def running_dispatch(proc: Proc) -> str | None:
    """The dispatch id a GPU worker has started and not yet finished, read from its log."""
    current = None
    for line in proc.log().splitlines():
        if "[GENERATE]" not in line or "dispatch=" not in line:
            continue
        dispatch_id = line.split("dispatch=", 1)[1].split()[0]
        if " started on " in line:
            current = dispatch_id
        elif dispatch_id == current and (" ready sha256=" in line or "fence_rejected" in line or "stopping:" in line):
            current = None
    return current


# ---------------------------------------------------------------------------------------------------------------
# Shared scenarios: one body, run at e2e size by tests/e2e and at fault-suite size by tests/faults.


def sigkill_trials(
    make_stack: Callable[..., Stack],
    figure: Callable[[str], None],
    *,
    kills: int,
    chapters: int,
    scenes: int,
    workers: int = 1,
    job: Mapping[str, Any] | None = None,
    lease_ttl: int = 3,
    book_id: str = "kill-book",
    timeout: float = 90.0,
) -> dict[str, Any]:
    """SIGKILL an image worker in the middle of a job `kills` times while a book's image stage runs.

    `chapters` x `scenes` image jobs of `job` params on `workers` image workers. At most one
    worker is down at a time (the others keep working); lane and book quota equal the worker
    count, so every kill hits a running job and nothing waits queued long enough to lose its
    lease. The presence TTL outlasts a restart, so the queue never looks consumerless (that
    would rightly BLOCK the command). Asserts: every pair ready with exactly one artifact under
    its final token, no killed dispatch ever committed, each killed pair released within lease
    TTL + one reconcile, no pair generating longer than that plus a job. Returns the figures.
    """
    from tests.integration.helpers import make_book

    job = dict(job or {"steps": 4, "step_seconds": 0.25})
    job_seconds = float(job.get("steps", 4)) * float(job.get("step_seconds", 0.0))
    stages = stage_table(
        audio=audio_stage(),
        image=image_stage(params=job, lease_ttl=lease_ttl, lane_limit=workers, book_quota=workers),
    )
    # With one lane slot the pair a kill released is the next one dispatched, and often killed again: these
    # kills are the test's doing, not a poison scene's, so the worker-lost limit (design §8.5) stays out of reach.
    stack = make_stack(stages=stages, presence_ttl_seconds=10, worker_lost_limit=kills + 1)
    cluster, settings = stack.cluster, stack.settings
    images = [cluster.gpu("image", wait=False) for _ in range(workers)]
    cluster.wait_ready(cluster.control(wait=False), *images, cluster.beat(wait=False))
    book = make_book(book_id, chapters=chapters, scenes=scenes)
    stack.rt.catalog.import_book(book)
    pairs = {pair for pair in stack.states(book.book_id) if pair[2] == "image"}
    assert len(pairs) == chapters * scenes

    settle = min(0.3, job_seconds / 3)  # into the job, with most of it still ahead
    monitor = GeneratingMonitor(stack, book.book_id)
    began = time.monotonic()
    try:
        stack.client.regenerate(book.book_id, ["image"])
        done: list[tuple[str, tuple[tuple[str, str, str], int], float]] = []
        while len(done) < kills:
            cluster.wait_ready(*images)  # the last one killed is back: one worker down at a time

            def busy() -> tuple[int, str] | None:
                for i, proc in enumerate(images):
                    dispatch_id = running_dispatch(proc)
                    if dispatch_id is not None:
                        return i, dispatch_id
                return None

            index, dispatch_id = wait_for(busy, 30, what="a job running on an image worker")
            victim = images[index]
            time.sleep(settle)
            # Frozen before it is looked at, so the job cannot commit between the look and the kill; the pause
            # lets Postgres finish a statement the worker had already sent (a COMMIT outlives its sender).
            cluster.send_signal(victim, signal.SIGSTOP)
            time.sleep(FROZEN_SETTLE)
            assets = stack.asset_rows(book.book_id)
            holder = [(pair, a["token"]) for pair, a in assets.items() if a["dispatch_id"] == dispatch_id]
            if running_dispatch(victim) != dispatch_id or not holder or assets[holder[0][0]]["state"] != "generating":
                cluster.send_signal(victim, signal.SIGCONT)
                continue  # it finished meanwhile; kill the next one
            cluster.kill(victim, signal.SIGKILL)
            done.append((dispatch_id, holder[0], time.monotonic()))
            images[index] = cluster.restart(victim, wait=False)
        cluster.wait_ready(*images)
        rows = stack.wait_commands(book.book_id, ["image"], "completed", timeout=timeout)
    finally:
        monitor.stop()
    elapsed = time.monotonic() - began

    assert monitor.errors == []
    assert rows["image"].progress["ready"] == len(pairs)
    states = stack.states(book.book_id)
    assert {s for (_, _, st), s in states.items() if st == "image"} == {"ready"}
    artifacts = stack.check_artifacts(book.book_id, pairs)  # one row per pair, under its final token
    killed_ids = {d for d, _, _ in done}
    committed = killed_ids & {r["dispatch_id"] for r in artifacts}
    assert not committed, f"killed dispatches that committed: {sorted(committed)}"
    ready_events = stack.events("job.ready", book.book_id)
    assert not killed_ids & {e["dispatch_id"] for e in ready_events}
    assert len(ready_events) == len(pairs), f"{len(ready_events)} job.ready events for {len(pairs)} pairs"

    # A killed job's pair leaves `generating` within lease TTL + one reconcile (+1 s for polling/tick jitter).
    bound = lease_ttl + settings.reconcile_seconds + 1.0
    recoveries = []
    for dispatch_id, key, killed_at in done:
        assert key in monitor.ended, f"{key} (dispatch {dispatch_id}) still generating"
        recoveries.append(monitor.ended[key] - killed_at)
    assert max(recoveries) <= bound, f"recoveries {recoveries} exceed {bound}s"
    # And no pair ever stayed `generating` longer than a job plus that bound.
    longest, which = monitor.longest()
    assert longest <= bound + job_seconds + 0.5, f"{which} generating for {longest:.1f}s"
    expired = stack.events("lease.expired", book.book_id)
    assert len(expired) >= kills
    jobs = len(stack.events("job.started", book.book_id))
    result = {
        "kills": len(done),
        "pairs": len(pairs),
        "jobs_started": jobs,
        "dispatches": len(stack.events("dispatch", book.book_id)),
        "expired": len(expired),
        "elapsed": elapsed,
        "recover_max": max(recoveries),
        "bound": bound,
        "longest": longest,
    }
    figure(
        f"kills {len(done)} on {workers} worker(s), pairs {len(pairs)}, jobs started {jobs}, "
        f"dispatches {result['dispatches']}, leases expired {len(expired)}, lost 0, duplicated 0 (1 artifact and "
        f"1 job.ready per pair), total {elapsed:.1f}s; kill -> pair released max {max(recoveries):.2f}s "
        f"(bound {bound:.0f}s); longest generating {longest:.2f}s"
    )
    return result
