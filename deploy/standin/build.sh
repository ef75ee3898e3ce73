#!/usr/bin/env bash
# Make every image that docker-compose.yml and the Dockerfile's FROM name available to the local Docker engine.
#
#   deploy/standin/build.sh                # the images the repository names
#   deploy/standin/build.sh redis:7-alpine # only these
#
# For each image: a real image already present is used as it is; otherwise `docker pull`; only when the pull
# fails (no registry reachable, as on our CI machines) is a STAND-IN built and tagged with that name, and this
# script says so. A stand-in is NOT the official image: it is Debian bookworm's packages (Python 3.11,
# PostgreSQL 15, Redis 7) with small entrypoints that behave as docker-compose.yml expects (POSTGRES_USER /
# POSTGRES_PASSWORD / POSTGRES_DB, pg_isready, redis-server and redis-cli, python and pip). Stand-ins carry the
# label org.animastor.standin; a later run tries the pull again, so a machine that reaches a registry gets the
# real image. All stand-ins share one base image made once by `debootstrap --variant=minbase` (about a minute)
# and cached by its tag. Needs: docker (an engine that answers), debootstrap, root.
#
# ANIMASTOR_STANDIN_MIRROR overrides the Debian mirror (default: this machine's own apt source).
# Exit status: 0 every image is here (real or stand-in), 1 a step failed, 3 a tool it needs is missing.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SUITE=bookworm
PACKAGES=ca-certificates,python3,python3-venv,postgresql-15,redis-server
BASE_RECIPE=2 # bump when the base's make-up changes without PACKAGES changing
BASE_TAG="animastor-standin-base:${SUITE}-$(printf '%s %s %s' "$SUITE" "$PACKAGES" "$BASE_RECIPE" | sha256sum | cut -c1-12)"
PULL_TIMEOUT="${ANIMASTOR_STANDIN_PULL_TIMEOUT:-60}"

say() { printf 'standin: %s\n' "$*"; }
die() {
    printf 'standin: error: %s\n' "$*" >&2
    exit 1
}
lacking() { # a tool this machine lacks: exit 3, so that a test can tell it from a failure
    printf 'standin: cannot build stand-ins here: %s\n' "$*" >&2
    exit 3
}

command -v docker >/dev/null || lacking "docker is not installed"
docker info >/dev/null 2>&1 || lacking "no Docker engine answers (start dockerd)"

# One run at a time on a machine: two test runs must not debootstrap twice or race on a tag.
exec 9>"${TMPDIR:-/tmp}/animastor-standin.lock"
flock 9

images_named() {
    {
        sed -n 's/^[[:space:]]*image:[[:space:]]*["'\'']\{0,1\}\([^"'\''[:space:]]*\).*/\1/p' "$ROOT/docker-compose.yml"
        sed -n 's/^FROM[[:space:]]\{1,\}\([^[:space:]]*\).*/\1/p' "$ROOT/Dockerfile"
    } | grep -v '^animastor-tasks:' | awk '!seen[$0]++'
}

standin_of() { docker image inspect --format '{{ index .Config.Labels "org.animastor.standin" }}' "$1" 2>/dev/null || true; }

host_mirror() {
    local uri=""
    if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
        uri="$(awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' /etc/apt/sources.list.d/*.sources |
            grep -E '/debian/?$' | head -n1 || true)"
    fi
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri="$(sed -n 's/^deb[[:space:]]\{1,\}\(\[[^]]*\][[:space:]]\{1,\}\)\{0,1\}\([^[:space:]]*\/debian\/\{0,1\}\)[[:space:]].*/\2/p' \
            /etc/apt/sources.list | head -n1)"
    fi
    printf '%s\n' "${uri:-http://deb.debian.org/debian}"
}

WORK=""
cleanup() {
    if [ -n "$WORK" ] && [ -d "$WORK" ]; then
        # debootstrap mounts /proc and /sys in the tree; never delete through a mount that is left over.
        awk -v w="$WORK/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l || true
        rm -rf --one-file-system "$WORK"
    fi
}
trap cleanup EXIT

ensure_base() {
    if docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
        return
    fi
    command -v debootstrap >/dev/null || lacking "debootstrap is not installed (apt-get install -y debootstrap)"
    [ "$(id -u)" = 0 ] || lacking "debootstrap needs root"
    local mirror started
    mirror="${ANIMASTOR_STANDIN_MIRROR:-$(host_mirror)}"
    WORK="$(mktemp -d "${TMPDIR:-/var/tmp}/animastor-standin.XXXXXX")"
    started=$SECONDS
    say "building the shared stand-in base $BASE_TAG: debootstrap --variant=minbase $SUITE from $mirror"
    if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$WORK/rootfs" "$mirror" \
        >"$WORK/debootstrap.log" 2>&1; then
        tail -n 30 "$WORK/debootstrap.log" >&2
        die "debootstrap failed (log above)"
    fi
    local r="$WORK/rootfs"
    # Slimmer and quicker to import: package caches, documentation, translations, the cluster the package
    # created (each stand-in initialises its own), and LLVM (PostgreSQL's JIT only; without it, no JIT).
    rm -rf "$r"/var/cache/apt/archives/*.deb "$r"/var/lib/apt/lists/* "$r"/usr/share/doc/* "$r"/usr/share/man/* \
        "$r"/usr/share/locale/* "$r"/var/lib/postgresql/15 "$r"/etc/postgresql/15/main \
        "$r"/usr/lib/postgresql/15/lib/llvmjit* "$r"/usr/lib/postgresql/15/lib/bitcode "$r"/usr/lib/x86_64-linux-gnu/libLLVM-*
    tar --numeric-owner -C "$r" -c . |
        docker import --message "animastor stand-in base: Debian $SUITE minbase + $PACKAGES" \
            --change 'LABEL org.animastor.standin=base' --change 'CMD ["/bin/bash"]' - "$BASE_TAG" >/dev/null
    cleanup
    WORK=""
    say "base $BASE_TAG ready in $((SECONDS - started)) s"
}

build_standin() {
    local image="$1" repo recipe
    repo="${image%%[:@]*}"
    repo="${repo##*/}"
    case "$repo" in
    python | postgres | redis) recipe="$repo" ;;
    *) die "$image cannot be pulled and there is no stand-in recipe for '$repo'" ;;
    esac
    ensure_base
    local log
    log="$(mktemp)"
    # The classic builder: a stand-in needs no build secret, and it works with any docker client.
    if ! DOCKER_BUILDKIT=0 docker build -q -f "$HERE/$recipe.Dockerfile" --build-arg BASE="$BASE_TAG" \
        --build-arg NAME="$image" -t "$image" "$HERE" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        die "building the stand-in for $image failed"
    fi
    rm -f "$log"
}

if [ "$#" -gt 0 ]; then
    images=("$@")
else
    mapfile -t images < <(images_named)
fi
summary=()
for image in "${images[@]}"; do
    if docker image inspect "$image" >/dev/null 2>&1 && [ -z "$(standin_of "$image")" ]; then
        summary+=("$image: the real image, already present")
        continue
    fi
    if timeout "$PULL_TIMEOUT" docker pull -q "$image" >/dev/null 2>&1; then
        summary+=("$image: the real image, pulled")
        continue
    fi
    say "$image cannot be pulled: building a STAND-IN from Debian $SUITE packages (not the official image)"
    build_standin "$image"
    summary+=("$image: STAND-IN built from Debian $SUITE packages (label org.animastor.standin)")
done
for line in "${summary[@]}"; do say "$line"; done
