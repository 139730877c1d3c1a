# Test-only S3 endpoint for `make test-compose` where MinIO's image cannot be had: moto's server
# (the same S3 the test suite runs against), standing in for the `minio` service through
# docker/compose.no-registry.yml. moto keeps objects in memory: never restart it mid-test.
ARG PYTHON_IMAGE=hindsight-test/python:3.11
FROM ${PYTHON_IMAGE}
ARG MOTO_VERSION=5.1.0
RUN python -m venv /opt/moto \
    && /opt/moto/bin/pip install --no-cache-dir "moto[server,s3]==${MOTO_VERSION}"
ENV PATH=/opt/moto/bin:$PATH
EXPOSE 9000
CMD ["moto_server", "-H", "0.0.0.0", "-p", "9000"]
