"""POST /v1/ray/events: Ray's own event exporter, pointed at Hindsight (docs/ray.md).

Ray's aggregator agent POSTs JSON arrays of events, uncompressed, with no credentials and
no batch identity, and retries any refused body forever. So:

- a body is acknowledged only once it is stored (``storage.ray.bridge``: split per Ray session,
  named by its content, so a retry is stored and counted once);
- nothing short of "not a JSON array" is answered 400: an event we do not understand is
  stored, counted as skipped, and the rest indexed;
- the tenant comes from a ``ray``-scoped token in the URL (``?token=``), since the exporter
  cannot send a header. The token never reaches a log line (the access log writes the path
  without the query; werkzeug's request log is redacted here), a metric label, or an error.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
import weakref
from typing import Any

from flask import Blueprint, Flask, current_app, g, request
from sqlalchemy.exc import DataError

from collector.body import read_body
from collector.ratelimit import enforce
from hindsight.schema import valid_name
from services.common.ops import BLOB_SECONDS, INDEX_SECONDS, timed
from services.common.store import Store
from services.common.web import ApiError, db, store
from storage.core.tokens import Principal
from storage.ray import bridge as ray
from storage.ray.events import NO_SESSION, TOO_DEEP, NotAnArray, split_array

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
        parts = ray.prepare(body, elements)
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
        key = ray.raw_key(principal.tenant, cluster, p.session, p.sha)
        with timed(BLOB_SECONDS.labels("put")):
            written.append(st.blobs.put(key, p.data, if_absent=True))
    # Stored: from here on nothing is lost. The index is derived (reindex rebuilds it).
    session = db()
    results = []
    for p in parts:
        t0 = time.perf_counter()
        try:
            res = ray.index_part(
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
                ray.PartResult(p.session, False, len(p.part.raw), {"unindexable": len(p.part.raw)})
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


# ------------------------------------------------------------------ metrics


def _metrics() -> tuple[Any, Any]:
    from prometheus_client import Counter

    bodies = Counter(
        "hindsight_ray_bodies_total", "Ray exporter bodies acknowledged", ["duplicate"]
    )
    events = Counter(
        "hindsight_ray_events_total",
        "Events of newly stored Ray bodies, by outcome (indexed, or skipped: stored, not understood)",
        ["outcome"],
    )
    return bodies, events


_BODIES, _EVENTS = _metrics()


def ray_bodies(duplicate: bool) -> Any:
    return _BODIES.labels(str(duplicate).lower())


def ray_events(outcome: str) -> Any:
    return _EVENTS.labels(outcome)


# ------------------------------------------------------------------ the token in logs

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


# ------------------------------------------------------------------ the sweeper thread


class Sweeper:
    """Merges the task patches its process holds (:class:`storage.ray.bridge.TaskHold`, every
    ``FLUSH_GAP`` seconds, writing the tasks the merge completes), writes the tasks other
    merges queued (:func:`storage.ray.bridge.emit_ready`, at most every ``EMIT_GAP`` seconds; in
    both, many bodies' tasks share a derived batch) and runs
    :func:`storage.ray.bridge.run_due` every ``interval`` while the index has open Ray work: closes
    jobs after their end has settled (or after they went idle) and writes late tasks. One
    per process; several processes cooperate (rows are taken with SKIP LOCKED). It parks
    when there is nothing open and wakes when a Ray body arrives.

    The thread holds its store weakly: when the app goes away (tests make many), the
    thread ends instead of keeping the app's engine and its connections alive."""

    PARKED = 30.0  # a parked sweeper looks again this often (and checks its app still exists)
    EMIT_GAP = 0.25  # bodies arriving meanwhile share one derived batch
    FLUSH_GAP = 0.25  # held task patches are looked at this often

    def __init__(self, st: Store) -> None:
        self._store = weakref.ref(st)
        s = st.settings
        self.settle = s.ray_settle_seconds
        self.idle = s.ray_idle_close_seconds
        self.interval = min(2.0, max(0.2, self.settle / 4))
        # Postgres: task patches are held a moment before they are merged (storage.ray.
        # TaskHold), well within the settle time a job's end waits for its tasks.
        self.hold: ray.TaskHold | None = None
        age = min(s.ray_hold_seconds, self.settle / 4)
        if st.engine.dialect.name == "postgresql" and age > 0:
            self.hold = ray.TaskHold(age=age)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._due_at = 0.0  # of the next run_due
        self._emit_at = 0.0  # of the next emit_ready while patches are held

    def start(self) -> None:
        """Start the thread (again after a fork: threads do not survive one)."""
        with self._lock:
            if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
                return
            self._pid = os.getpid()
            self._thread = threading.Thread(
                target=self._run, daemon=True, name="hindsight-ray-sweeper"
            )
            self._thread.start()

    def wake(self) -> None:
        self.start()
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread and merge the task patches still held (a process that exits
        without this leaves them to another sweeper's recovery, ~10 s later)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        st = self._store()
        if self.hold is not None and len(self.hold) and st is not None:
            try:
                self.hold.flush(st.sessions, st.blobs, force=True, cache=st.ids)
            except Exception:
                logger.warning(
                    "Ray sweeper: held task patches not merged at exit; another "
                    "sweeper merges their bodies again",
                    exc_info=True,
                )

    def _pass(self) -> bool:
        """One pass; whether there is still open work (None-safe if the app is gone)."""
        st = self._store()
        if st is None:
            self._stop.set()
            return False
        if self.hold is not None:
            self.hold.flush(st.sessions, st.blobs, cache=st.ids)
        now = time.monotonic()
        if now >= self._emit_at:
            self._emit_at = now + self.EMIT_GAP
            ray.emit_ready(st.sessions, st.blobs, cache=st.ids)
        with st.sessions() as session:
            busy = ray.has_open_work(session)
        if busy and time.monotonic() >= self._due_at:
            self._due_at = time.monotonic() + self.interval
            ray.recover_held(st.sessions, st.blobs)
            ray.run_due(st.sessions, st.blobs, settle=self.settle, idle=self.idle, cache=st.ids)
        return busy

    def _run(self) -> None:
        # A fresh process looks once, after a while, for work left by an earlier one.
        self._wake.wait(self.PARKED / 6)
        backoff = self.interval
        while not self._stop.is_set():
            self._wake.clear()
            began = time.monotonic()
            try:
                busy = self._pass()
                backoff = self.interval
            except Exception:  # the index or blob store is down: try again later
                logger.warning("Ray sweeper: pass failed; retrying", exc_info=True)
                backoff = min(60.0, backoff * 2)
                self._stop.wait(backoff)
                continue
            if self._stop.is_set():
                return
            if self.hold is not None and len(self.hold):
                # A pass every FLUSH_GAP, counted from its start: a pass that took longer
                # (the sweeper behind the requests) is followed at once.
                self._stop.wait(max(0.0, began + self.FLUSH_GAP - time.monotonic()))
            elif busy:
                # Let bodies gather, then go again when one arrives (or run_due is due).
                self._stop.wait(self.EMIT_GAP)
                self._wake.wait(max(0.0, self._due_at - time.monotonic()))
            else:
                self._wake.wait(self.PARKED)


def init_ray(app: Flask) -> None:
    """Per-process Ray state of a collector (or embedded) app."""
    _redact_werkzeug()
    st: Store = app.extensions["hindsight"]
    if st.settings.ray_sweeper:
        sweeper = Sweeper(st)
        app.extensions["hindsight.ray_sweeper"] = sweeper
        sweeper.start()
        atexit.register(_merge_held_at_exit, weakref.ref(sweeper))


def _merge_held_at_exit(ref: weakref.ref[Sweeper]) -> None:
    """A process that exits normally (a gunicorn worker stopped or recycled) merges the
    task patches it holds instead of leaving them to another sweeper's recovery."""
    sweeper = ref()
    if sweeper is not None and sweeper.hold is not None:  # even empty: a flush may be under way
        sweeper.stop(timeout=5.0)
