# animastor-tasks: one image for every process (control worker, GPU workers, beat, Flower, metrics).
# The process is chosen by the command (see docker-compose.yml); configuration is the ANIMASTOR_* environment.
#
#   docker build -t animastor-tasks:local .
#   docker run --rm animastor-tasks:local animastor-tasks --help
#
# The builtin generator needs no GPU. A stage whose generator runs on the GPU in this container needs the
# NVIDIA container toolkit on the host and a device reservation (docker-compose.yml reserves one per GPU worker).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, so that a code change does not reinstall them.
COPY pyproject.toml README.md ./
COPY animastor_tasks ./animastor_tasks
RUN pip install .

COPY flowerconfig.py celeryconfig.py ./

# Never run workers as root (Celery warns, and a job would own the host's files).
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/animastor --create-home animastor \
    && mkdir -p /var/lib/animastor/artifacts /var/lib/animastor/beat \
    && chown -R animastor:animastor /var/lib/animastor
USER animastor

ENV ANIMASTOR_ARTIFACT_ROOT=/var/lib/animastor/artifacts

CMD ["animastor-tasks", "--help"]
