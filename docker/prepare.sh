#!/usr/bin/env bash
# Get a machine ready for `make test-compose`: Docker's engine, Compose, and every image the
# full stack needs, built locally when no image registry answers.
#
#   docker/prepare.sh [ENV_FILE]        (root; ENV_FILE default test-artifacts/compose/images.env)
#
# 1. apt-get install docker.io docker-compose debootstrap, where missing (Debian's packages).
# 2. Start dockerd if no engine answers (it is left running).
# 3. Images. Where Docker Hub answers, the real images in docker-compose.yml are used. Where it
#    does not: a Debian bookworm base from `debootstrap --variant=minbase` + `docker import`,
#    Debian's python3 on it (docker/python.Dockerfile), Postgres from Debian's postgresql-15 with
#    the official image's contract (docker/postgres.Dockerfile), and moto's S3 server standing in
#    for MinIO (docker/moto.Dockerfile, through docker/compose.no-registry.yml). Either way the
#    Python base trusts this host's CA bundle, so pip inside image builds works behind a
#    TLS-inspecting proxy.
# 4. Write ENV_FILE: the images, compose files and compose command tests/compose/ use.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENV_FILE=${1:-$ROOT/test-artifacts/compose/images.env}
LOG_DIR=$(dirname "$ENV_FILE")
mkdir -p "$LOG_DIR"
export DOCKER_BUILDKIT=0 # the classic builder needs no frontend image from a registry

say() { printf 'prepare: %s\n' "$*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
FIGURES=()
figure() { FIGURES+=("$1=$2"); say "$1: $2 s"; }

# --- 1. packages ---------------------------------------------------------------------------
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        say "missing ${missing[*]}: install them (Debian: apt-get install ${missing[*]}) or run as root"
        exit 1
    fi
    t=$(now)
    say "installing ${missing[*]} ..."
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >"$LOG_DIR/apt.log" 2>&1 \
        || { tail -20 "$LOG_DIR/apt.log"; exit 1; }
    figure packages_s "$(since "$t")"
fi

# --- 2. the engine -------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        say "no Docker engine answers and only root can start one here"
        exit 1
    fi
    t=$(now)
    say "starting dockerd (log: /var/log/hindsight-dockerd.log) ..."
    setsid dockerd >>/var/log/hindsight-dockerd.log 2>&1 </dev/null &
    for _ in $(seq 1 120); do
        docker info >/dev/null 2>&1 && break
        sleep 0.5
    done
    docker info >/dev/null 2>&1 || { tail -20 /var/log/hindsight-dockerd.log; exit 1; }
    figure dockerd_start_s "$(since "$t")"
fi

# --- 3. images -----------------------------------------------------------------------------
CA_BUNDLE=""
for candidate in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
    if [ -n "$candidate" ] && [ -f "$candidate" ]; then CA_BUNDLE=$candidate; break; fi
done
[ -n "$CA_BUNDLE" ] || { say "no CA bundle found (set PIP_CERT)"; exit 1; }
CONTEXT=$(mktemp -d)
trap 'rm -rf "$CONTEXT"' EXIT
cp "$CA_BUNDLE" "$CONTEXT/ca-certificates.crt"
cp "$ROOT/docker/postgres-entrypoint.sh" "$CONTEXT/"

build() { # build TAG DOCKERFILE [--build-arg ...]
    local tag=$1 file=$2 t
    shift 2
    t=$(now)
    docker build -t "$tag" -f "$ROOT/docker/$file" "$@" "$CONTEXT" >"$LOG_DIR/build-${file%.Dockerfile}.log" 2>&1 \
        || { tail -30 "$LOG_DIR/build-${file%.Dockerfile}.log"; exit 1; }
    figure "build_${file%.Dockerfile}_s" "$(since "$t")"
}

PYTHON_IMAGE=hindsight-test/python:3.11
if timeout 120 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    REGISTRY=1
    say "an image registry answers: the real images of docker-compose.yml are used"
    build "$PYTHON_IMAGE" python.Dockerfile --build-arg BASE=python:3.11-slim
else
    REGISTRY=0
    say "no image registry answers: building base images locally"
    BASE=hindsight-test/debian:bookworm
    if ! docker image inspect "$BASE" >/dev/null 2>&1; then
        t=$(now)
        rootfs=$(mktemp -d /var/tmp/hindsight-rootfs.XXXXXX)
        trap 'rm -rf "$CONTEXT" "$rootfs"' EXIT
        say "debootstrap --variant=minbase bookworm (a few minutes) ..."
        debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian \
            >"$LOG_DIR/debootstrap.log" 2>&1 || { tail -20 "$LOG_DIR/debootstrap.log"; exit 1; }
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -c . | docker import - "$BASE" >/dev/null
        rm -rf "$rootfs"
        figure debootstrap_import_s "$(since "$t")"
    fi
    build "$PYTHON_IMAGE" python.Dockerfile --build-arg BASE="$BASE" --build-arg INSTALL_PYTHON=1
    build hindsight-test/postgres:15 postgres.Dockerfile --build-arg BASE="$BASE"
    MOTO_VERSION=$("${HINDSIGHT_PYTHON:-$ROOT/.venv/bin/python}" -c "import importlib.metadata as m; print(m.version('moto'))" 2>/dev/null || echo 5.1.0)
    build hindsight-test/moto:latest moto.Dockerfile --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" \
        --build-arg MOTO_VERSION="$MOTO_VERSION"
fi

# --- 4. what the tests use -------------------------------------------------------------------
# Compose v2 (`docker compose`, what users run) where it exists and a registry answers (it builds
# with BuildKit, whose Dockerfile frontend comes from a registry); else v1 (`docker-compose`),
# which needs the project name as -p (it rejects a top-level `name:`).
if [ "$REGISTRY" = 1 ] && docker compose version >/dev/null 2>&1; then
    COMPOSE="docker compose"
else
    COMPOSE="docker-compose"
fi
FILES="docker-compose.yml:docker/compose.test.yml"
{
    echo "HINDSIGHT_TEST_REGISTRY=$REGISTRY"
    echo "HINDSIGHT_TEST_COMPOSE=$COMPOSE"
    echo "HINDSIGHT_TEST_PYTHON_IMAGE=$PYTHON_IMAGE"
    echo "HINDSIGHT_IMAGE=hindsight-test/hindsight:latest"
    if [ "$REGISTRY" = 0 ]; then
        echo "POSTGRES_IMAGE=hindsight-test/postgres:15"
        echo "HINDSIGHT_TEST_S3_IMAGE=hindsight-test/moto:latest"
        FILES="$FILES:docker/compose.no-registry.yml"
    fi
    echo "HINDSIGHT_TEST_COMPOSE_FILES=$FILES"
    echo "HINDSIGHT_TEST_PREPARE_FIGURES=${FIGURES[*]:-}"
} >"$ENV_FILE"
say "ready ($COMPOSE; $(docker version --format 'engine {{.Server.Version}}')); wrote $ENV_FILE"
