#!/bin/sh
# Stand-in for the official postgres image's entrypoint (the part docker-compose.yml relies on):
# on an empty PGDATA, initdb with POSTGRES_USER / POSTGRES_PASSWORD, create POSTGRES_DB, accept password
# logins from other containers; then run the server as the postgres user. Local socket logins are trusted,
# as in the official image.
set -eu
export PGDATA="${PGDATA:-/var/lib/postgresql/data}"
if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /var/run/postgresql
    chown -R postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [ "${1:-}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?stand-in postgres: POSTGRES_PASSWORD must be set (as with the official image)}"
    user="${POSTGRES_USER:-postgres}"
    db="${POSTGRES_DB:-$user}"
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    if [ "$db" != postgres ]; then
        pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        createdb -U "$user" "$db"
        pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
    echo "stand-in postgres: initialised $PGDATA (user $user, database $db)"
fi
exec "$@"
