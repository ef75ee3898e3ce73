# animastor-tasks: one image for every process (control worker, GPU workers, beat, Flower, metrics).
# The process is chosen by the command (see docker-compose.yml); configuration is the ANIMASTOR_* environment.
#
#   DOCKER_BUILDKIT=1 docker build -t animastor-tasks:local .
#   docker run --rm animastor-tasks:local animastor-tasks --help
#
# Behind a TLS-intercepting proxy, pip must trust the proxy's CA: give the host's CA bundle as a BuildKit
# secret. It is mounted only while pip runs and never lands in a layer (no certificate, key or credential
# is baked into the image):
#
#   DOCKER_BUILDKIT=1 docker build --secret id=ca-bundle,src=/etc/ssl/certs/ca-certificates.crt \
#       -t animastor-tasks:local .
#
# BuildKit is required (RUN --mount): Docker 23+ uses it by default; older clients need DOCKER_BUILDKIT=1,
# and docker-compose 1.x also COMPOSE_DOCKER_CLI_BUILD=1.
#
# The builtin generator needs no GPU. A stage whose generator runs on the GPU in this container needs the
# NVIDIA container toolkit on the host and a device reservation (docker-compose.yml reserves one per GPU worker).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, from pyproject.toml alone: a change to the source reuses this layer. The build
# requirements are installed here too, so that the source layer below needs no network.
# EXTRAS: optional dependency groups of pyproject.toml, comma-separated (`docker compose build --build-arg EXTRAS=otel`
# for tracing); none by default.
ARG EXTRAS=""
COPY pyproject.toml ./
RUN --mount=type=secret,id=ca-bundle,required=false \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
    && python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
extras = [d for e in os.environ['EXTRAS'].split(',') if e for d in p['project']['optional-dependencies'][e]]; \
print('\n'.join(p['project']['dependencies'] + p['build-system']['requires'] + extras))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# flowerconfig.py: Flower's settings and auth rule (basic auth required), read wherever `celery -A animastor_tasks
# flower` runs (FLOWER_CONF below); without it Flower came up with no auth on every interface.
COPY README.md celeryconfig.py flowerconfig.py ./
COPY animastor_tasks ./animastor_tasks
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info

# Never run workers as root (Celery warns, and a job would own the host's files).
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/animastor --create-home animastor \
    && mkdir -p /var/lib/animastor/artifacts \
    && chown -R animastor:animastor /var/lib/animastor
USER animastor

ENV ANIMASTOR_ARTIFACT_ROOT=/var/lib/animastor/artifacts \
    FLOWER_CONF=/app/flowerconfig.py

CMD ["animastor-tasks", "--help"]
