# syntax=docker/dockerfile:1
#
# One image for every Hindsight server process: the collector, the query service and the
# one-shot `hindsight db upgrade` / `hindsight tokens create` commands. docker-compose.yml picks
# the process with `command:`; all configuration comes from HINDSIGHT_* environment variables
# (docs/deploy.md). Nothing secret is baked in.

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: install the project and its server extra into a self-contained virtualenv ---------
FROM ${PYTHON_IMAGE} AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/hindsight
ENV PATH=/opt/hindsight/bin:$PATH

WORKDIR /src
# .dockerignore keeps .git, .venv, tests, bench and any .env file out of the context.
COPY . .
# The server extra only: no test or dev dependencies in the image. A regular (non-editable)
# install, so the source tree is not needed at run time and stays in this stage.
RUN pip install '.[server]'

# --- runtime --------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="hindsight" \
      org.opencontainers.image.description="Hindsight history server for Dask runs: collector and query service"

ENV PATH=/opt/hindsight/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HINDSIGHT_DATA_DIR=/var/lib/hindsight

RUN groupadd --system --gid 10001 hindsight \
    && useradd --system --uid 10001 --gid hindsight --home-dir /var/lib/hindsight \
        --create-home --shell /usr/sbin/nologin hindsight

COPY --from=build /opt/hindsight /opt/hindsight

USER hindsight:hindsight
WORKDIR /var/lib/hindsight

EXPOSE 8700 8701

# The default process is the collector; docker-compose.yml sets the command of every service
# and its healthcheck (GET /readyz with the Python stdlib: the image has no curl).
CMD ["gunicorn", "--config", "python:services.gunicorn_conf", "--bind", "0.0.0.0:8700", "--workers", "2", "--worker-class", "gthread", \
     "--threads", "4", "collector.app:create_app()"]
