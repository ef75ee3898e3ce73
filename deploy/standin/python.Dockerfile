# Stand-in for python:3.11-slim: Debian bookworm's Python 3.11 in a virtual environment first on PATH, so that
# `python` and `pip install` behave as in the official image (whose Python lives in /usr/local).
# Built by deploy/standin/build.sh only where the real image cannot be pulled.
ARG BASE
FROM ${BASE}
ARG NAME
LABEL org.animastor.standin="${NAME}" org.animastor.standin.recipe="python"
ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8
RUN python3 -m venv /opt/python && /opt/python/bin/python -c "import ssl, sqlite3, venv"
CMD ["python3"]
