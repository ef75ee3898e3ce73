# Stand-in for redis:*: Debian bookworm's Redis 7 (redis-server, redis-cli) working in /data.
# Built by deploy/standin/build.sh only where the real image cannot be pulled.
ARG BASE
FROM ${BASE}
ARG NAME
LABEL org.animastor.standin="${NAME}" org.animastor.standin.recipe="redis"
ENV LANG=C.UTF-8
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN mkdir -p /data && chown redis:redis /data
VOLUME /data
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
