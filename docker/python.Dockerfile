# Test-only base image for `make test-compose` (docker/prepare.sh): the Python the project's
# Dockerfile builds on, passed to it as PYTHON_IMAGE. Where no image registry answers, BASE is a
# debootstrapped Debian bookworm and Python is Debian's python3 (3.11); where one answers, BASE is
# python:3.11-slim and nothing is installed. Either way pip trusts the host's CA bundle: package
# downloads may pass a TLS-inspecting proxy whose certificate only the host's bundle holds.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG INSTALL_PYTHON=0
ENV LANG=C.UTF-8
RUN if [ "$INSTALL_PYTHON" = 1 ]; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv python-is-python3 ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi
COPY ca-certificates.crt /usr/local/share/hindsight-test/ca-certificates.crt
ENV PIP_CERT=/usr/local/share/hindsight-test/ca-certificates.crt
