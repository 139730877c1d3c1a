"""POST /v1/ray/events: Ray's own event exporter, pointed at Hindsight (docs/ray.md).

Ray's aggregator agent POSTs JSON arrays of events, uncompressed, with no credentials and
no batch identity, and retries any refused body forever. So:

- a body is acknowledged only once it is stored (``storage.ray.bodies``: split per Ray
  session, named by its content, so a retry is stored and counted once);
- nothing short of "not a JSON array" is answered 400: an event we do not understand is
  stored, counted as skipped, and the rest indexed;
- the tenant comes from a ``ray``-scoped token in the URL (``?token=``), since the exporter
  cannot send a header. The token never reaches a log line (the access log writes the path
  without the query; werkzeug's request log is redacted here), a metric label, or an error.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from flask import Blueprint, Flask, current_app, g, request
from prometheus_client import Counter
from sqlalchemy.exc import DataError

from collector.body import read_body
from collector.ratelimit import enforce
from hindsight.schema import valid_name
from services.common.ops import BLOB_SECONDS, INDEX_SECONDS, timed
from services.common.web import ApiError, db, store
from storage.core.tokens import Principal
from storage.ray import bodies
from storage.ray import merge as ray_merge
from storage.ray.events import NO_SESSION
from storage.ray.wire import TOO_DEEP, NotAnArray, split_array

logger = logging.getLogger(__name__)

bp = Blueprint("ray", __name__)

DEFAULT_CLUSTER = "ray"
# Scopes that must not ride in a URL: a leaked URL then cannot read or administer anything.
_NOT_IN_URLS = frozenset({"read", "admin"})


def _principal() -> Principal:
    """The caller's tenant: the open principal (loopback, no auth), a ``ray`` token in the
    URL, or a ``ray``/``ingest`` token in an ``Authorization: Bearer`` header (a proxy
    may add one). Error messages never repeat the token."""
    st = store()
    if st.open_principal is not None:
        g.principal = st.open_principal
        return st.open_principal
    header = request.headers.get("Authorization", "")
    scheme, _, bearer = header.partition(" ")
    in_url = request.args.get("token")
    token = bearer.strip() if scheme.lower() == "bearer" and bearer.strip() else in_url
    challenge = {"WWW-Authenticate": "Bearer"}
    if not token:
        raise ApiError(
            401,
            "unauthorized",
            "missing token: point Ray's exporter at the URL `hindsight tokens create "
            "--tenant NAME --for ray` prints (it carries ?token=...)",
            challenge,
        )
    principal = st.principal_for(token)
    if principal is None:
        raise ApiError(401, "unauthorized", "unknown or revoked token", challenge)
    g.principal = principal
    if token == in_url and principal.scopes & _NOT_IN_URLS:
        raise ApiError(
            403,
            "forbidden",
            "a token in a URL must be created with --for ray (scope ray only): this one can "
            "also read or administer, and URLs end up in logs",
        )
    if not principal.scopes & {"ray", "ingest"}:
        raise ApiError(403, "forbidden", "token lacks the 'ray' scope")
    return principal


@bp.post("/v1/ray/events")
def post_ray_events() -> Any:
    principal = _principal()
    settings = current_app.config["SETTINGS"]
    cluster = request.args.get("cluster", DEFAULT_CLUSTER)
    if not valid_name(cluster):
        raise ApiError(
            400, "invalid_parameter", "cluster: use up to 128 of A-Z a-z 0-9 _ . - (?cluster=NAME)"
        )
    if request.mimetype not in ("", "application/json"):
        raise ApiError(415, "unsupported_media_type", "Content-Type must be application/json")
    limiter = current_app.extensions["hindsight.ratelimit"]
    # an empty bucket: refused before the body is read
    enforce(limiter, principal.tenant, None, request.content_length)
    raw, body, _ = read_body(settings.max_batch_bytes, settings.body_timeout)
    try:
        # Counted before the work when a rate limit is set; else split only if needed
        # (storage.ray.events.parse).
        elements = split_array(body) if limiter.enabled else None
        if elements is not None:
            enforce(limiter, principal.tenant, len(elements))
        parts = bodies.prepare(body, elements)
    except NotAnArray as exc:
        why = ": this one is nested too deeply to read" if str(exc) == TOO_DEEP else ""
        raise ApiError(
            400, "not_an_array", f"a Ray exporter body is a JSON array of events{why}"
        ) from None
    elements_count = sum(len(p.part.raw) for p in parts)

    st = store()
    # With a sweeper, tasks are written by it (``emit_ready``), many bodies to a batch.
    sweeper = current_app.extensions.get("hindsight.ray_sweeper")
    hold = sweeper.hold if sweeper is not None else None
    written = []
    for p in parts:
        key = bodies.raw_key(principal.tenant, cluster, p.session, p.sha)
        with timed(BLOB_SECONDS.labels("put")):
            written.append(st.blobs.put(key, p.data, if_absent=True))
    # Stored: from here on nothing is lost. The index is derived (reindex rebuilds it).
    session = db()
    results = []
    for p in parts:
        t0 = time.perf_counter()
        try:
            res = ray_merge.index_part(
                session,
                st.blobs,
                tenant_id=principal.tenant_id,
                tenant=principal.tenant,
                cluster=cluster,
                stored=p,
                now=time.time(),
                defer_tasks=sweeper is not None,
                cache=st.ids,
                hold=hold is not None,
            )
            session.commit()
            if res.held:  # committed: the manifest row says they are held
                assert hold is not None and res.session_id is not None and res.body_id is not None
                hold.add(res.session_id, res.body_id, res.held)
            results.append(res)
        except DataError as exc:
            # A value the index cannot hold (the reader bounds every one it knows of): the
            # body is stored, and refusing it would have Ray send it again forever. Logged
            # without the statement's parameters (the body's values).
            session.rollback()
            logger.error(
                "Ray body %s: the index cannot hold it; stored, not indexed: %s", p.sha, exc.orig
            )
            results.append(
                ray_merge.PartResult(
                    p.session, False, len(p.part.raw), {"unindexable": len(p.part.raw)}
                )
            )
        INDEX_SECONDS.observe(time.perf_counter() - t0)
    # Back-pressure: a request's threads share the process with the sweeper's, and left
    # alone they can outrun its flushes (the hold, and the tasks waiting in it, grow).
    if hold is not None and hold.full:  # far behind: everything, now
        hold.flush(st.sessions, st.blobs, force=True, cache=st.ids)
    elif hold is not None and hold.behind:  # help the sweeper (or wait for its flush)
        hold.flush(st.sessions, st.blobs, cache=st.ids)
    if sweeper is not None:
        sweeper.wake()
    skipped: dict[str, int] = {}
    for r in results:
        for k, n in r.skipped.items():
            skipped[k] = skipped.get(k, 0) + n
    duplicate = (
        bool(results)
        and not any(written)  # (an empty array: nothing to repeat)
        and all(r.duplicate or r.session == NO_SESSION for r in results)
    )
    ray_bodies(duplicate).inc()
    if not duplicate:
        ray_events("indexed").inc(sum(r.events for r in results) - sum(skipped.values()))
        ray_events("skipped").inc(sum(skipped.values()))
    return {
        "accepted": elements_count,
        "skipped": skipped,
        "duplicate": duplicate,
        "sessions": [r.session for r in results],
        "tasks_written": sum(r.emitted for r in results),
    }, 200


_BODIES = Counter("hindsight_ray_bodies_total", "Ray exporter bodies acknowledged", ["duplicate"])
_EVENTS = Counter(
    "hindsight_ray_events_total",
    "Events of newly stored Ray bodies, by outcome (indexed, or skipped: stored, not understood)",
    ["outcome"],
)


def ray_bodies(duplicate: bool) -> Any:
    return _BODIES.labels(str(duplicate).lower())


def ray_events(outcome: str) -> Any:
    return _EVENTS.labels(outcome)


_TOKEN_IN_QUERY = re.compile(r"([?&]token=)[^&\s\"]*")


def redact(text: str) -> str:
    """``text`` with the value of any ``token=`` query parameter replaced."""
    return _TOKEN_IN_QUERY.sub(r"\1[redacted]", text)


class RedactTokens(logging.Filter):
    """Removes ``?token=...`` from a record (werkzeug logs each request line, query
    string included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "token=" in message:
            record.msg = redact(message)
            record.args = None
        return True


def _redact_werkzeug() -> None:
    log = logging.getLogger("werkzeug")
    if not any(isinstance(f, RedactTokens) for f in log.filters):
        log.addFilter(RedactTokens())


def init_ray(app: Flask) -> None:
    """Per-process Ray state of a collector (or embedded) app: token redaction in the
    request log (the sweeper thread is started with the others, ``storage.jobs.workers``)."""
    _redact_werkzeug()
