#!/bin/sh
# Stand-in for the official redis image's entrypoint: `redis-server ...` runs as the redis user in /data;
# any other command runs as given.
set -eu
case "${1:-}" in -*|*.conf) set -- redis-server "$@" ;; esac
if [ "${1:-}" = redis-server ] && [ "$(id -u)" = 0 ]; then
    chown -R redis:redis .
    exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
