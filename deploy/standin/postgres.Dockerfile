# Stand-in for postgres:*: Debian bookworm's PostgreSQL 15 with an entrypoint that honours POSTGRES_USER,
# POSTGRES_PASSWORD and POSTGRES_DB. Built by deploy/standin/build.sh only where the real image cannot be pulled.
ARG BASE
FROM ${BASE}
ARG NAME
LABEL org.animastor.standin="${NAME}" org.animastor.standin.recipe="postgres"
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data \
    LANG=C.UTF-8
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /var/lib/postgresql/data
STOPSIGNAL SIGINT
EXPOSE 5432
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
