"""Operations plumbing for both services: Prometheus metrics, structured access logs and
admission control (bounded in-flight requests and request bytes per process).

Metrics are per process by default. Under gunicorn set ``PROMETHEUS_MULTIPROC_DIR`` (an empty
directory, wiped before start) and ``/metrics`` answers for every worker of the instance at
once (prometheus-client's multiprocess mode; ``services/gunicorn_conf.py`` marks dead workers).
No metric carries a tenant label: ``/metrics`` is unauthenticated, and tenant names must not
leak through it (and per-tenant series would grow without bound).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flask import Flask, Response, g, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import multiprocess as prom_multiprocess

from services.common.errors import error_response, unavailable
from services.common.jsonlog import JsonFormatter

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("hindsight.access")

# Latency buckets in seconds: blob PUTs and index transactions sit between 1 ms and 1 s.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Under multiprocess mode every metric writes to a file in the directory from the first
# metric on: one missing (a process started outside gunicorn, whose on_starting makes it)
# stopped the import. Only gunicorn's on_starting empties it.
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)

# One set of metric objects per process (module level: prometheus-client registers each
# name once; several apps in one test process share them, so tests compare deltas).
REQUESTS = Counter(
    "hindsight_http_requests_total", "HTTP requests answered", ["service", "route", "status"]
)
REQUEST_SECONDS = Histogram(
    "hindsight_http_request_seconds",
    "Time to answer a request",
    ["service", "route"],
    buckets=_BUCKETS,
)
IN_FLIGHT = Gauge(
    "hindsight_http_in_flight_requests",
    "Requests being served",
    ["service"],
    multiprocess_mode="livesum",
)
IN_FLIGHT_BYTES = Gauge(
    "hindsight_http_in_flight_bytes",
    "Request body bytes (as sent) being served",
    ["service"],
    multiprocess_mode="livesum",
)
EVENTS = Counter("hindsight_ingested_events_total", "Events in newly stored batches")
BATCHES = Counter("hindsight_ingested_batches_total", "Batches acknowledged", ["duplicate"])
BYTES = Counter(
    "hindsight_ingested_bytes_total", "Request body bytes of acknowledged batches", ["encoding"]
)
REJECTS = Counter(
    "hindsight_rejected_requests_total",
    "Ingest requests answered 4xx/5xx, by error code",
    ["reason"],
)
BLOB_SECONDS = Histogram(
    "hindsight_blob_seconds", "Blob store call latency", ["op"], buckets=_BUCKETS
)
INDEX_SECONDS = Histogram(
    "hindsight_index_seconds", "Index transaction latency (one batch)", buckets=_BUCKETS
)


@contextmanager
def timed(histogram: Any) -> Iterator[None]:
    """Observe the block's wall time in ``histogram`` (also when it raises)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        histogram.observe(time.perf_counter() - t0)


#: Families only a collector moves: the query service leaves them out of its /metrics (it
#: showed hindsight_ingested_events_total 0 and an empty index latency histogram).
INGEST_ONLY = frozenset(
    {
        "hindsight_ingested_events",
        "hindsight_ingested_batches",
        "hindsight_ingested_bytes",
        "hindsight_index_seconds",
        "hindsight_blob_seconds",
        "hindsight_ray_bodies",
        "hindsight_ray_events",
    }
)


class _Without:
    """A registry's families but those named."""

    def __init__(self, source: Any, names: frozenset[str]) -> None:
        self.source, self.names = source, names

    def collect(self) -> Iterator[Any]:
        return (f for f in self.source.collect() if f.name not in self.names)


def metrics_response(hide: frozenset[str] = frozenset()) -> Response:
    """The exposition text: every worker's under multiprocess mode, else this process's;
    without the families ``hide`` names."""
    source: Any = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        source = CollectorRegistry()
        prom_multiprocess.MultiProcessCollector(source)
    data = generate_latest(_Without(source, hide) if hide else source)
    return Response(data, mimetype=CONTENT_TYPE_LATEST)


class _OurHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler this module installed, so a second app replaces rather than adds."""


def configure_logging(level: str, fmt: str) -> None:
    """Root logging as the settings say: ``text`` is ``basicConfig`` with the time (and
    leaves a host's own handlers alone); ``json`` installs one JSON-lines handler on stderr."""
    root = logging.getLogger()
    if fmt == "json":
        for h in list(root.handlers):
            if isinstance(h, _OurHandler):
                root.removeHandler(h)
        handler = _OurHandler()
        handler.setFormatter(JsonFormatter())
        root.addHandler(handler)
        root.setLevel(level.upper())
    else:  # with the time (basicConfig's default line had none)
        logging.basicConfig(
            level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )


class Admission:
    """Bounds the requests (and their body bytes) one process serves at once: past either
    bound the request is answered 503 + Retry-After before its body is read, so a flood costs
    headers, not memory. A single body larger than the byte bound passes when nothing else is
    in flight (the batch cap, not this, limits one request)."""

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def enter(self, size: int) -> bool:
        with self._lock:
            if self.max_requests and self.requests >= self.max_requests:
                return False
            if self.max_bytes and self.bytes and self.bytes + size > self.max_bytes:
                return False
            self.requests += 1
            self.bytes += size
            return True

    def leave(self, size: int) -> None:
        with self._lock:
            self.requests -= 1
            self.bytes -= size


_INGEST = ("/v1/batches", "/v1/ray/events")
# Routes that must answer while the process is saturated: probes and the scrape.
_EXEMPT = ("/healthz", "/readyz", "/metrics")


def install(app: Flask, service: str) -> None:
    """Metrics, access log and admission control around every request of ``app``."""
    settings = app.config["SETTINGS"]
    admission = Admission(settings.max_in_flight, settings.max_in_flight_bytes)
    app.extensions["hindsight.admission"] = admission
    in_flight = IN_FLIGHT.labels(service)
    in_flight_bytes = IN_FLIGHT_BYTES.labels(service)

    @app.before_request
    def _admit() -> Any:
        g.t0 = time.perf_counter()
        if request.path in _EXEMPT:
            return None
        size = request.content_length or 0
        if not admission.enter(size):
            g.rejected_overload = True
            REJECTS.labels("overloaded").inc()
            err = unavailable("the collector is at its in-flight limit; retry later")
            return error_response(err.status, "overloaded", err.message, err.headers)
        g.admitted = size
        in_flight.inc()
        in_flight_bytes.inc(size)
        return None

    @app.after_request
    def _observe(resp: Response) -> Response:
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        duration = time.perf_counter() - g.get("t0", time.perf_counter())
        REQUESTS.labels(service, route, str(resp.status_code)).inc()
        REQUEST_SECONDS.labels(service, route).observe(duration)
        if route in _INGEST and resp.status_code >= 400 and not g.get("rejected_overload"):
            REJECTS.labels(_error_code(resp)).inc()
        if settings.access_log and request.path not in _EXEMPT:
            principal = g.get("principal")
            access_logger.info(
                "%s %s %s %.1fms %s",  # the tenant last ("-": none): text lines had none
                request.method,
                request.path,
                resp.status_code,
                duration * 1000,
                principal.tenant if principal is not None else "-",
                extra={
                    "method": request.method,
                    "path": request.path,
                    "route": route,
                    "status": resp.status_code,
                    "tenant": principal.tenant if principal is not None else None,
                    "duration_ms": round(duration * 1000, 2),
                    "bytes_in": request.content_length or 0,
                    "remote": request.remote_addr,
                },
            )
        return resp

    @app.teardown_request
    def _release(exc: BaseException | None) -> None:
        size = g.pop("admitted", None)
        if size is not None:
            admission.leave(size)
            in_flight.dec()
            in_flight_bytes.dec(size)


def _error_code(resp: Response) -> str:
    try:
        body = resp.get_json(silent=True) or {}
        return str(body["error"]["code"])
    except (KeyError, TypeError):
        return f"http_{resp.status_code}"
