"""Test stores: a database of its own per run, a Redis db of its own, cleaned around each test.

The environment is set when pytest starts, before any test imports the Celery app, so
worker subprocesses started by end-to-end tests inherit exactly the same stores.
Where no Postgres/Redis is reachable (a fresh machine), `animastor_tasks.dev.stores` starts local ones.

`make test` runs two pytest-xdist workers, each on stores of its own (database, Redis db, key prefix), and in
two fixed halves (`RUN_APART`): the suites that bring their own servers or need none run beside the ones on
the machine's shared servers. Why: the cluster and deployment suites spend most of their time waiting
(partitions held for 30 s, leases running out, images building), and running them one after the other with
the rest took the whole suite past 25 minutes on 2 cores. The fault suite (private Redis and Postgres servers,
a RabbitMQ vhost of its own) runs apart too when the shared servers' suites run (`make test`): beside them it
left the other worker idle for the last 14 of 25 minutes (summed test times 667 s apart, 1,504 s shared).
Without them (`make faults`: faults and cluster) it is the other half, beside the cluster suite.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

_RUN = uuid.uuid4().hex[:8]
#: Test directories run by one xdist worker while another runs all the rest: these bring their own servers
#: (network namespaces, a compose stack, a built wheel) or use none, and share nothing with the rest but
#: this run's stores, which each worker has its own of.
RUN_APART = frozenset({"cluster", "deploy", "unit", "dev"})
#: Run apart when the run has tests of the shared half too, else they are that half.
APART_BESIDE_SHARED = frozenset({"faults"})
#: Files kept in the shared half all the same: a test on the AMQP broker may be on its shared `/` vhost (where
#: `rabbitmqctl` cannot make one of its own), as the e2e ones are, and must not run beside them.
KEPT_SHARED = frozenset({"tests/faults/test_broker_outage.py"})
_made_database: list[str] = []  # the database this process named and made, dropped when pytest ends
_artifact_root: dict[str, str] = {}  # this process's artifact directory, removed when pytest ends


def _worker() -> tuple[str, int]:
    """This process's xdist worker name and index (`main`, 0 without xdist)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return (name, int(name.removeprefix("gw"))) if name.startswith("gw") else ("main", 0)


def redis_db_for_worker(url: str, index: int) -> str:
    """`url` with the Redis database `index` below its own (wrapping at 16), so that workers of one run never
    flush each other's keys or share a broker queue; `url` itself for index 0. In every form the project
    writes: the path of `redis://`, the `db` of `unix://`, kombu's `virtual_host` of `redis+socket://`."""
    if index == 0:
        return url
    parts = urlsplit(url)
    if parts.scheme in ("redis", "rediss"):
        db = (int(parts.path.strip("/") or 0) - index) % 16
        return urlunsplit(parts._replace(path=f"/{db}"))
    key = {"unix": "db", "redis+socket": "virtual_host"}.get(parts.scheme)
    if key is None:  # not a Redis URL (an AMQP broker): shared, as it was
        return url
    query = dict(parse_qsl(parts.query))
    query[key] = str((int(query.get(key, 0)) - index) % 16)
    return f"{url.split('?', 1)[0]}?{urlencode(query)}"  # as written: urlunsplit drops the `//` of `unix:///`


def _configure_environment() -> None:
    worker, index = _worker()
    if os.environ.get("ANIMASTOR_TEST_CONFIGURED") == worker:
        return
    from animastor_tasks.dev.probes import database_name, ensure_database, with_database
    from animastor_tasks.dev.stores import ensure_stores

    given = os.environ.get("ANIMASTOR_TEST_DATABASE_URL")
    base = {
        "ANIMASTOR_DATABASE_URL": given or f"postgresql://postgres@127.0.0.1:5432/animastor_test_{_RUN}",
        "ANIMASTOR_REDIS_URL": os.environ.get("ANIMASTOR_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
    }
    overrides, lines = ensure_stores(base, log=lambda _: None)
    if overrides and os.environ.get("CI"):  # CI starts real servers: a suite on embedded ones would hide that
        raise pytest.UsageError(f"CI: the stores CI starts do not answer ({' | '.join(lines)}); see .ci/run")
    env = {**base, **overrides}
    if "ANIMASTOR_DATABASE_URL" in overrides:
        # A local embedded server: give this run its own database on it as well.
        env["ANIMASTOR_DATABASE_URL"] = with_database(overrides["ANIMASTOR_DATABASE_URL"], f"animastor_test_{_RUN}")
    elif given and index:  # the database named for the run is the first worker's; the others make their own
        env["ANIMASTOR_DATABASE_URL"] = with_database(given, f"{database_name(given)}_{worker}")
    if env["ANIMASTOR_DATABASE_URL"] != given:
        _made_database.append(env["ANIMASTOR_DATABASE_URL"])
    ensure_database(env["ANIMASTOR_DATABASE_URL"])
    env.setdefault("ANIMASTOR_BROKER_URL", os.environ.get("ANIMASTOR_TEST_BROKER_URL", env["ANIMASTOR_REDIS_URL"]))
    env["ANIMASTOR_REDIS_URL"] = redis_db_for_worker(env["ANIMASTOR_REDIS_URL"], index)
    env["ANIMASTOR_BROKER_URL"] = redis_db_for_worker(env["ANIMASTOR_BROKER_URL"], index)
    env["ANIMASTOR_KEY_PREFIX"] = f"t{_RUN}"
    # The run's own artifacts (the default is `./artifacts` in the checkout: shared by runs and workers, and a file
    # already there of the right size is not written again, so later runs tested no write at all).
    env["ANIMASTOR_ARTIFACT_ROOT"] = _artifact_root.setdefault(worker, tempfile.mkdtemp(prefix=f"animastor-{_RUN}-"))
    env["ANIMASTOR_TEST_CONFIGURED"] = worker
    env["ANIMASTOR_TEST_STORES"] = " | ".join(lines)
    os.environ.update(env)


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and _worker()[0] == "main":
        return  # the xdist controller runs no test: each worker makes stores of its own
    _configure_environment()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The database this process made goes with it, whether or not a test used it."""
    from animastor_tasks.dev.probes import drop_database

    for url in _made_database:
        drop_database(url)
    for root in _artifact_root.values():
        shutil.rmtree(root, ignore_errors=True)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The two halves (see the module's docstring), each a unit of work xdist gives to one worker. A scope of
    its own rather than `xdist_group` marks: pytest 9.2 ignores the node ids those marks rewrite
    (pytest-xdist issue 1386), and the tests were spread over both workers."""
    from xdist.scheduler import LoadScopeScheduling

    def top(nodeid: str) -> str:
        return nodeid.split("/")[1] if nodeid.startswith("tests/") else ""

    class Halves(LoadScopeScheduling):
        shared: bool | None = None  # whether the run has tests of the shared half proper: known once collected

        def shared_run(self) -> bool:
            if self.shared is None and self.collection is not None:
                self.shared = any(top(n) not in RUN_APART | APART_BESIDE_SHARED for n in self.collection)
            return bool(self.shared)

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.split("::")[0] in KEPT_SHARED:
                return "shared"
            if top(nodeid) in APART_BESIDE_SHARED:
                return "apart" if self.shared_run() else "shared"
            return "apart" if top(nodeid) in RUN_APART else "shared"

    return Halves(config, log)


@pytest.fixture(scope="session")
def settings():  # type: ignore[no-untyped-def]
    from animastor_tasks.config import Settings

    return Settings.from_env()


@pytest.fixture(scope="session")
def migrated(settings):  # type: ignore[no-untyped-def]
    from animastor_tasks.adapters.postgres.migrations import migrate
    from animastor_tasks.adapters.postgres.pool import Database

    db = Database(settings.database_url)
    migrate(db)
    yield db
    db.close()


TABLES = "events, artifacts, cancel_tombstones, command_targets, commands, asset_states, scenes, chapters, books"


@pytest.fixture
def clean_stores(settings, migrated) -> Iterator[None]:  # type: ignore[no-untyped-def]
    import redis

    with migrated.transaction() as conn:
        conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    client = redis.Redis.from_url(settings.redis_url)
    client.flushdb()
    client.close()
    yield


@pytest.fixture
def rt(settings, clean_stores):  # type: ignore[no-untyped-def]
    """This process's wiring on the test stores (its `ports` for the flows, its raw stores for
    assertions), publishing real Celery messages to the real broker."""
    from animastor_tasks.flow import rebuild
    from animastor_tasks.worker import wiring

    wiring.reset()
    runtime = wiring.current()
    # A Redis reconcile has been through, as a running farm's: without its bookmark the tick rebuilds every book
    # with work into the due index (flow/rebuild.py), as after a loss of Redis's data, which a test shows by wiping it.
    runtime.ports.locks.set_bookmark(rebuild.BOOKMARK, "")
    yield runtime
    wiring.reset()
