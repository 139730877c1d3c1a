# Test-only Postgres for `make test-compose` where no image registry answers: Debian bookworm's
# postgresql-15 behind an entrypoint with the official image's contract (POSTGRES_USER,
# POSTGRES_PASSWORD, POSTGRES_DB; data initialised once in the /var/lib/postgresql/data volume;
# pg_isready on the default socket). docker-compose.yml uses it through POSTGRES_IMAGE.
ARG BASE=hindsight-test/debian:bookworm
FROM ${BASE}
ENV LANG=C.UTF-8
# No cluster from the package's postinst: the entrypoint makes the one in the volume.
RUN mkdir -p /etc/postgresql-common \
    && echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf \
    && apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql \
    && chmod 2777 /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /var/lib/postgresql/data
EXPOSE 5432
# Postgres's "fast" shutdown, as in the official image.
STOPSIGNAL SIGINT
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
