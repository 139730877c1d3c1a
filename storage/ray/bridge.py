"""Ray runs, recorded like Dask runs: exporter bodies in, protocol records out.

Ray's aggregator agent POSTs JSON arrays of events (``storage/ray/events.py`` reads them).
This module keeps them and turns them into what the rest of Hindsight already indexes:

1. **The raw body is the source of truth.** Each body is stored, split per Ray session, under
   ``ray/v1/{tenant}/{cluster}/{session}/{sha256}.json.zst`` before it is acknowledged. Ray
   sends no batch identity, so the name is the content: a retried identical body is stored
   once, and the manifest (``ray_bodies``, unique per session and hash) merges it once.
2. **Merge tables** (``ray_jobs``, ``ray_tasks``, ``ray_nodes``, ``ray_workers``,
   ``ray_actors``) hold what the events say, merged commutatively: values are set while
   NULL, times take the earliest, flags OR. Events arrive in any order, from several nodes,
   at least once; a duplicate or reordered event changes nothing.
3. **A task reaches the writer once.** The rollups (histograms, per-worker sums, cluster
   hours, prefix days) add, so a task attempt must be counted exactly once, with its final
   start and stop. ``ray_tasks.emitted`` flips to true once, under the row's lock, so the
   transition happens in one transaction even with several collector processes. The merge
   that completes a task (its definition, RUNNING and end (FINISHED/FAILED) all known)
   flips it in the same statement and queues it in ``ray_ready``; the body's transaction or
   the sweeper (:func:`emit_ready`) takes it from there and writes it. The sweeper
   (:func:`run_due`) writes the rest, flipping ``emitted`` with ``UPDATE ... WHERE NOT
   emitted``: tasks whose end was seen ``settle`` seconds ago (RUNNING or the definition
   lost), every task of a job that has closed, and stragglers that arrive after.
4. **Emitted records are protocol batches** (``hindsight.schema``): tasks as ``TaskEvent``
   (Ray's own facts in ``attrs``), jobs as ``RunEvent``, worker processes as
   ``WorkerEvent``. Each is stored under ``ray/derived/v1/...`` named by its content and
   indexed by the ordinary writer (``storage.ingest.writer.index_batch``), so runs, tasks, Parquet,
   quantiles, compare, histories, traces and pages work unchanged. Derived batches are
   outside ``v1/``: ``reindex`` rebuilds them from the raw bodies, never reads them.
5. **A job closes** ``settle`` seconds after its end was seen (the job's FINISHED, or its
   driver task's end), or after ``idle`` seconds without an event when neither arrives (a
   short script whose cluster died with it). Closing emits the job's remaining tasks (a task
   without an end is ``lost``) and the run's ``finished`` event.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, NamedTuple

import msgspec
import zstandard
from sqlalchemy import (
    Boolean,
    Float,
    Text,
    and_,
    bindparam,
    case,
    cast,
    column,
    delete,
    false,
    func,
    literal_column,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session, sessionmaker

from hindsight.schema import (
    MAX_TIME,
    Batch,
    RunEvent,
    SchemaError,
    SessionEvent,
    StartStop,
    TaskEvent,
    WorkerEvent,
    decode_batch,
    encode_batch,
)
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.core.idcache import IdCache
from storage.core.tokens import ensure_tenant
from storage.ingest.writer import index_batch
from storage.ray.events import (
    NO_SESSION,
    SessionPart,
    TaskPatch,
    clean,
    error_summary,
    parse,
)
from storage.runs.runlogs import LOST_RAY_EXITS

logger = logging.getLogger(__name__)

RAW_PREFIX = "ray/v1"
DERIVED_PREFIX = "ray/derived/v1"
AGENT = "ray"  # the agent name of derived batches
STORE_LEVEL = 3
# Raw exporter bodies: level 1 was both faster (1.4 vs 2.3 ms a 1,000-event body) and
# smaller (48 vs 51 bytes an event) than 3 on Ray's JSON.
RAW_LEVEL = 1
_RAW_RE = re.compile(
    r"^ray/v1/(?P<tenant>[^/]+)/(?P<cluster>[^/]+)/(?P<session>[^/]+)/(?P<sha>[0-9a-f]{64})\.json\.zst$"
)
# Keys per statement when a list of task keys is bound (SQLite allows 32,766 parameters).
_CHUNK = 2000


def raw_key(tenant: str, cluster: str, session: str, sha: str) -> str:
    return f"{RAW_PREFIX}/{tenant}/{cluster}/{session}/{sha}.json.zst"


def derived_key(tenant: str, cluster: str, session: str, seq: int) -> str:
    return f"{DERIVED_PREFIX}/{tenant}/{cluster}/{session}/{seq:014x}.json.zst"


def session_prefixes(tenant: str, cluster: str, session: str) -> list[str]:
    """The blob prefixes that hold a session's Ray data (for retention)."""
    return [f"{p}/{tenant}/{cluster}/{session}/" for p in (RAW_PREFIX, DERIVED_PREFIX)]


# ------------------------------------------------------------------ bodies


@dataclass
class StoredPart:
    """One session's share of a body, ready to store: its events and the bytes to keep."""

    part: SessionPart
    sha: str
    data: bytes  # zstd, as stored

    @property
    def session(self) -> str:
        return self.part.session


def prepare(body: bytes, elements: list[msgspec.Raw] | None = None) -> list[StoredPart]:
    """Split a body per Ray session (one in practice). A one-session body is kept byte for
    byte; otherwise each part is the array of its events' exact bytes."""
    parts = parse(body, elements)
    out = []
    cctx = zstandard.ZstdCompressor(level=RAW_LEVEL)
    for part in parts.values():
        raw = body if len(parts) == 1 else b"[" + b",".join(bytes(r) for r in part.raw) + b"]"
        out.append(StoredPart(part, hashlib.sha256(raw).hexdigest(), cctx.compress(raw)))
    return out


def read_stored(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True).read()


# ------------------------------------------------------------------ statements


_encode = msgspec.json.Encoder().encode

# How a task patch merges into its row (the merge statements) and into a held patch
# (``_fold``): set once, the earliest time, ``defined`` OR-ed.
_TASK_FIRST = (
    "job_id",
    "name",
    "func",
    "module",
    "task_type",
    "parent_id",
    "actor_id",
    "node_id",
    "worker_id",
    "pid",
    "error_type",
    "error_message",
)
_TASK_LOW = ("pending_at", "submitted_at", "running_at", "finished_at", "failed_at")


@functools.cache
def _statements(dialect: str) -> SimpleNamespace:
    """The merge statements, built once per dialect (see ``storage.ingest.writer._statements``)."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert

        def lo(a: Any, b: Any) -> Any:
            return func.least(func.coalesce(a, b), func.coalesce(b, a))

        def hi(a: Any, b: Any) -> Any:
            return func.greatest(func.coalesce(a, b), func.coalesce(b, a))
    else:
        from sqlalchemy.dialects.sqlite import insert

        def lo(a: Any, b: Any) -> Any:
            return func.min(func.coalesce(a, b), func.coalesce(b, a))

        def hi(a: Any, b: Any) -> Any:
            return func.max(func.coalesce(a, b), func.coalesce(b, a))

    st = SimpleNamespace(dialect=dialect, insert=insert)

    def upsert(
        model: Any,
        keys: list[str],
        first: Iterable[str] = (),
        low: Iterable[str] = (),
        high: Iterable[str] = (),
        ored: Iterable[str] = (),
        returning: Any = None,
        bulk: bool = False,
        taken: Any = None,
    ) -> Any:
        t = model.__table__
        ins = insert(t)
        if bulk:
            # Postgres: the body's patches as one JSON array (msgspec encodes them as they
            # are, unset fields left out), read server-side by jsonb_to_recordset. A 666-row
            # VALUES list (16,000 parameters) cost ~3x as much to send, parse and plan; one
            # array per column ~15 ms of psycopg2 adapting values, against ~1 ms to encode
            # the JSON. jsonb without the NULLs: 0.7 ms for Postgres to read 666 patches,
            # against 2.4 ms as json with them (json_to_recordset hashes every object).
            given = ("session_id", "first_seen", "end_seen", "emitted", "emitted_before")
            cols = [c for c in t.c if c.name not in given]
            rs = (
                func.jsonb_to_recordset(cast(bindparam("p_rows", type_=Text()), JSONB))
                .table_valued(*(column(c.name, c.type) for c in cols))
                .render_derived(name="x", with_types=True)
            )
            now = bindparam("p_now", type_=Float())
            ended = case((or_(rs.c.finished_at.is_not(None), rs.c.failed_at.is_not(None)), now))
            ins = ins.from_select(
                [*given, *(c.name for c in cols)],
                select(
                    bindparam("p_session", type_=t.c.session_id.type),
                    now,
                    ended,
                    taken(rs) if taken is not None else false(),
                    false(),
                    *(
                        func.coalesce(rs.c[c.name], false())
                        if c.name == "defined"
                        else rs.c[c.name]
                        for c in cols
                    ),
                ),
            )
        ex = ins.excluded
        sets: dict[str, Any] = {}
        sets.update({c: func.coalesce(t.c[c], ex[c]) for c in first})
        sets.update({c: lo(t.c[c], ex[c]) for c in low})
        sets.update({c: hi(t.c[c], ex[c]) for c in high})
        sets.update({c: or_(t.c[c], ex[c]) for c in ored})
        if taken is not None:
            sets.update(emitted=or_(t.c.emitted, taken(None)), emitted_before=t.c.emitted)
        stmt = ins.on_conflict_do_update(index_elements=keys, set_=sets)
        return stmt.returning(*returning) if returning is not None else stmt

    N, W, A, J, T = (x.__table__ for x in (m.RayNode, m.RayWorker, m.RayActor, m.RayJob, m.RayTask))
    R = m.RayReady.__table__

    def complete_of(
        session: Any,
        node: Any,
        defined: Any,
        running: Any,
        finished: Any,
        failed: Any,
        node_known: Any = None,
    ) -> Any:
        """Complete: defined, RUNNING and ended, on a node whose IP is known (the worker
        label needs it; a node's definition may arrive after its tasks' events)."""
        if node_known is None:
            node_known = (
                select(N.c.node_id)
                .where(N.c.session_id == session, N.c.node_id == node, N.c.ip.is_not(None))
                .exists()
            )
        return and_(
            defined.is_(True),
            running.is_not(None),
            or_(finished.is_not(None), failed.is_not(None)),
            node_known,
        )

    C, S, B = m.Cluster.__table__, m.Session.__table__, m.RayBody.__table__
    st.cluster = insert(C).on_conflict_do_nothing(index_elements=["tenant_id", "name"])
    st.cluster_id = select(C.c.id).where(
        C.c.tenant_id == bindparam("tenant_id"), C.c.name == bindparam("name")
    )
    st.session = insert(S).on_conflict_do_nothing(index_elements=["cluster_id", "name"])
    st.session_id = select(S.c.id).where(
        S.c.cluster_id == bindparam("cluster_id"), S.c.name == bindparam("name")
    )
    st.body = (
        insert(B).on_conflict_do_nothing(index_elements=["session_id", "sha"]).returning(B.c.id)
    )
    # Through the ids cached for the session's derived batches, guarded by their names (as
    # ``storage.ingest.writer`` does): None when the ids are stale, or the body a duplicate.
    body_cols = ("session_id", "sha", "blob_key", "events", "bytes", "received_at", "tasks_merged")
    guard = select(*(bindparam(c, type_=B.c[c].type) for c in body_cols)).where(
        select(S.c.id)
        .join(C, C.c.id == S.c.cluster_id)
        .where(
            S.c.id == bindparam("session_id"),
            S.c.name == bindparam("p_session"),
            C.c.id == bindparam("p_cluster_id"),
            C.c.name == bindparam("p_cluster"),
            C.c.tenant_id == bindparam("p_tenant_id"),
        )
        .exists()
    )
    st.body_guarded = (
        insert(B)
        .from_select(list(body_cols), guard)
        .on_conflict_do_nothing(index_elements=["session_id", "sha"])
        .returning(B.c.id)
    )
    EC = m.RayEventCount.__table__
    ins = insert(EC)
    st.counts = ins.on_conflict_do_update(
        index_elements=["session_id", "kind", "event_type"],
        set_={"count": EC.c.count + ins.excluded.count},
    )
    st.node = upsert(
        m.RayNode,
        ["session_id", "node_id"],
        first=("ip", "hostname", "name", "death_reason", "resources"),
        low=("started_at", "alive_at", "dead_at"),
        returning=(N.c.node_id, N.c.ip),
    )
    st.worker = upsert(
        m.RayWorker,
        ["session_id", "worker_id"],
        first=("node_id", "pid", "worker_type", "job_id", "exit_type", "exit_detail"),
        low=("started_at", "ended_at"),
        returning=tuple(W.c),
    )
    st.actor = upsert(
        m.RayActor,
        ["session_id", "actor_id"],
        first=("job_id", "class_name", "name", "node_id", "worker_id", "pid"),
        low=("alive_at", "dead_at"),
    )
    st.job = upsert(
        m.RayJob,
        ["session_id", "job_id"],
        first=("entrypoint", "driver_pid", "driver_node"),
        low=("created_at", "finished_at", "driver_exit_at", "end_seen"),
        high=("last_event_at",),
        returning=tuple(J.c),
    )
    st.task = upsert(
        m.RayTask,
        ["session_id", "task_id", "attempt"],
        first=_TASK_FIRST,
        low=(*_TASK_LOW, "first_seen", "end_seen"),
        ored=("defined",),
    )
    st.ready = insert(R).on_conflict_do_nothing(index_elements=["session_id", "task_id", "attempt"])
    st.task_bulk = st.task_taken = None
    if dialect == "postgresql":
        # The merge takes a task it completes for writing in the same statement: ``emitted``
        # flips (with the row's lock held, so exactly one merge sees it flip) and the task
        # is queued in ray_ready. Its row is written twice (definition, end), not three
        # times, and nothing scans ray_tasks for complete tasks.
        def taken(rs: Any) -> Any:
            """Complete after the merge: of a new row (``rs``, the patches) or of the
            existing row merged with the patch (``rs`` None: ON CONFLICT's SET)."""
            if rs is not None:
                return complete_of(
                    bindparam("p_session", type_=T.c.session_id.type),
                    rs.c.node_id,
                    func.coalesce(rs.c.defined, false()),
                    rs.c.running_at,
                    rs.c.finished_at,
                    rs.c.failed_at,
                )
            ex = insert(T).excluded
            # Written out: SQLAlchemy does not correlate a subquery inside ON CONFLICT's SET.
            node_known = literal_column(
                "EXISTS (SELECT 1 FROM ray_nodes AS n WHERE n.session_id = ray_tasks.session_id"
                " AND n.node_id = coalesce(ray_tasks.node_id, excluded.node_id)"
                " AND n.ip IS NOT NULL)",
                Boolean(),
            )
            return complete_of(
                None,
                None,
                or_(T.c.defined, ex.defined),
                func.coalesce(T.c.running_at, ex.running_at),
                func.coalesce(T.c.finished_at, ex.finished_at),
                func.coalesce(T.c.failed_at, ex.failed_at),
                node_known,
            )

        merged = upsert(
            m.RayTask,
            ["session_id", "task_id", "attempt"],
            first=_TASK_FIRST,
            low=(*_TASK_LOW, "first_seen", "end_seen"),
            ored=("defined",),
            bulk=True,
            taken=taken,
        )
        up = merged.returning(*T.c).cte("up")
        flipped = and_(up.c.emitted.is_(True), up.c.emitted_before.is_(False))
        st.task_bulk = (
            insert(R)
            .from_select(
                ["session_id", "task_id", "attempt", "job_id"],
                select(up.c.session_id, up.c.task_id, up.c.attempt, up.c.job_id).where(flipped),
            )
            .on_conflict_do_nothing(index_elements=["session_id", "task_id", "attempt"])
        )
        # The same merge, returning the rows of the tasks it takes instead of queueing them:
        # for a caller that writes them in the same transaction (TaskHold.flush), so that a
        # task is never taken without being written, and the queue's insert and delete
        # (~17 us of Postgres a task under bench/ray_ingest.py) are spared.
        st.task_taken = select(*up.c).where(flipped)
    # Statements on a list of (task, attempt) keys serve SQLite's paths: Postgres merges and
    # queues in one statement (``task_bulk``), flips with SKIP LOCKED subqueries
    # (``_emit_locked``) and drains the queue in one (``take_ready``).
    keys = tuple_(T.c.task_id, T.c.attempt).in_(bindparam("p_keys", expanding=True))
    complete = (
        complete_of(
            T.c.session_id, T.c.node_id, T.c.defined, T.c.running_at, T.c.finished_at, T.c.failed_at
        ),
    )
    st.complete = complete
    st.rows = select(*T.c).where(T.c.session_id == bindparam("p_session"), keys)
    st.emit_complete = (
        update(T)
        .where(T.c.session_id == bindparam("p_session"), keys, T.c.emitted.is_(False), *complete)
        .values(emitted=True)
        .returning(*T.c)
    )
    st.emit_keys = (
        update(T)
        .where(T.c.session_id == bindparam("p_session"), keys, T.c.emitted.is_(False))
        .values(emitted=True)
        .returning(*T.c)
    )
    st.emit_all_complete = (
        update(T)
        .where(T.c.session_id == bindparam("p_session"), T.c.emitted.is_(False), *complete)
        .values(emitted=True)
        .returning(*T.c)
    )
    return st


def _stmts(db: Session) -> SimpleNamespace:
    return _statements(db.get_bind().dialect.name)


def _skip_locked(q: Any, db: Session) -> Any:
    """Rows another transaction holds are left for it (Postgres); SQLite has one writer."""
    return q.with_for_update(skip_locked=True) if db.get_bind().dialect.name == "postgresql" else q


def ensure_session(
    db: Session, tenant_id: int, cluster: str, session: str, now: float
) -> tuple[int, int]:
    """(cluster id, session id), created if new."""
    st = _stmts(db)
    db.execute(
        st.cluster, {"tenant_id": tenant_id, "name": cluster, "first_seen": now, "last_seen": now}
    )
    cluster_id = db.execute(st.cluster_id, {"tenant_id": tenant_id, "name": cluster}).scalar_one()
    db.execute(
        st.session, {"cluster_id": cluster_id, "name": session, "first_seen": now, "last_seen": now}
    )
    session_id = db.execute(st.session_id, {"cluster_id": cluster_id, "name": session}).scalar_one()
    return cluster_id, session_id


# ------------------------------------------------------------------ translation


def session_started(session: str) -> float | None:
    """The start a Ray session name carries (``session_2026-11-22_21-42-54_270620_23949``)."""
    match = re.match(r"^session_(\d{4})-(\d\d)-(\d\d)_(\d\d)-(\d\d)-(\d\d)_(\d{6})_", session)
    if not match:
        return None
    y, mo, d, h, mi, s, us = (int(x) for x in match.groups())
    try:
        return datetime(y, mo, d, h, mi, s, us, tzinfo=UTC).timestamp()
    except ValueError:
        return None


def worker_label(
    ip: str | None, pid: int | None, node: str | None, worker: str | None
) -> str | None:
    """A Ray worker process as the pages show it: ``ip:pid`` (or the ids when unknown)."""
    if pid and ip:
        return f"{ip}:{pid}"
    if pid and node:
        return f"node-{node[:12]}:{pid}"
    if worker:
        return f"worker-{worker[:12]}"
    return None


def _time_ok(*values: float | None) -> bool:
    for v in values:
        if v is None or not 0.0 <= v <= MAX_TIME:
            return False
    return True


def task_state(row: Any) -> str:
    """The task's last state Ray reported."""
    if row.failed_at is not None:
        return "FAILED"
    if row.finished_at is not None:
        return "FINISHED"
    if row.running_at is not None:
        return "RUNNING"
    if row.submitted_at is not None:
        return "SUBMITTED_TO_WORKER"
    if row.pending_at is not None:
        return "PENDING"
    return "UNKNOWN"


def task_event(row: Any, ip: str | None, pid: int | None) -> TaskEvent:
    """A merged ``ray_tasks`` row as a protocol task record.

    Start is RUNNING (as Ray's State API reports ``start_time_ms``), else SUBMITTED_TO_WORKER
    when RUNNING never arrived, but for an actor's method call: SUBMITTED_TO_WORKER puts it
    in the actor's queue, where it may wait, or end without running (the actor died, the
    driver exited), so without RUNNING it has no start, nor a worker, as in Ray's State
    API; stop is FINISHED or FAILED. Ray's own facts go in ``attrs`` (what the record's
    fields already say - name, job, start, stop - is not repeated). Written out field by
    field: it runs once per Ray task, in the sweeper's hot loop."""
    failed, finished, running = row.failed_at, row.finished_at, row.running_at
    end = failed if failed is not None else finished
    status = "erred" if failed is not None else "memory" if finished is not None else "lost"
    start, unrun = running, False
    if running is None:
        if row.task_type == "ACTOR_TASK":
            unrun = True  # queued at the actor's process, not run there
        else:
            start = row.submitted_at
    startstops = []
    if (
        start is not None
        and end is not None
        and 0.0 <= start <= MAX_TIME
        and 0.0 <= end <= MAX_TIME
    ):
        startstops = [StartStop("compute", start if start < end else end, end)]
    pid = row.pid or (None if unrun else pid)
    attrs: dict[str, Any] = {"attempt": row.attempt, "state": task_state(row)}
    v = row.task_type
    if v is not None:
        attrs["type"] = v
    v = row.module
    if v is not None:
        attrs["module"] = v
    v = row.parent_id
    if v is not None:
        attrs["parent"] = v
    v = row.actor_id
    if v is not None:
        attrs["actor"] = v
    if row.node_id is not None:
        attrs["node"] = row.node_id
    if row.worker_id is not None:
        attrs["worker_id"] = row.worker_id
    if pid is not None:
        attrs["pid"] = pid
    v = row.error_type
    if v is not None:
        attrs["error_type"] = v
    v = row.pending_at
    if v is not None and 0.0 <= v <= MAX_TIME:
        attrs["pending_at"] = v
    v = row.submitted_at
    if v is not None and 0.0 <= v <= MAX_TIME:
        attrs["submitted_at"] = v
    if not startstops and end is not None and 0.0 <= end <= MAX_TIME:
        # Ended without being sent to a worker (cancelled while pending, a call on a dead
        # actor) or without running (an actor's call): no phase to draw, but the end Ray's
        # State API reports as ``end_time_ms``.
        attrs["ended_at"] = end
    if start is not None:
        attrs["start_from"] = "RUNNING" if running is not None else "SUBMITTED_TO_WORKER"
    if not row.defined:
        attrs["defined"] = False  # the definition never came: no name or function
    exception = traceback = None
    if status != "memory":
        exception, traceback = error_summary(row.error_message, row.error_type)
    return TaskEvent(
        key=row.task_id,
        prefix=row.func or "unknown",
        status=status,
        group=row.name,
        run=row.job_id,
        worker=None if unrun and not pid else worker_label(ip, pid, row.node_id, row.worker_id),
        startstops=startstops,
        exception=exception,
        traceback=traceback,
        attrs=attrs,
    )


def run_name(entrypoint: str | None) -> str | None:
    return clean(" ".join(entrypoint.split()) if entrypoint else None, 1024)


def job_started(job: Any) -> RunEvent | None:
    if not _time_ok(job.created_at):
        return None
    return RunEvent(
        event="started",
        id=job.job_id,
        time=job.created_at,
        name=run_name(job.entrypoint),
        client=f"ray driver pid {job.driver_pid}" if job.driver_pid else None,
    )


def worker_events(w: Any, ip: str | None) -> list[WorkerEvent]:
    """A Ray worker process's joined/left events (task workers only: drivers and IO
    workers run no tasks)."""
    if w.worker_type not in (None, "WORKER") or not ip or not w.pid:
        return []
    address = worker_label(ip, w.pid, w.node_id, w.worker_id)
    assert address is not None
    out = []
    if _time_ok(w.started_at):
        out.append(
            WorkerEvent(event="joined", address=address, time=w.started_at, name=w.worker_id)
        )
    if _time_ok(w.ended_at):
        reason = ": ".join(x for x in (w.exit_type, w.exit_detail) if x) or None
        expected, status = _EXITS.get(w.exit_type or "", (None, None))
        out.append(
            WorkerEvent(
                event="left",
                address=address,
                time=w.ended_at,
                name=w.worker_id,
                reason=clean(reason, 1024),
                expected=expected,
                status=status,
            )
        )
    return out


#: Ray's worker exit types as a departure's ``expected`` and last ``status`` (the run page's
#: cause: ``storage.runs.runlogs.cause_of``); a crash's reason starts with its exit type.
_EXITS: dict[str, tuple[bool | None, str | None]] = {
    "INTENDED_SYSTEM_EXIT": (True, None),  # Ray let it go (idle, or its job ended): retired
    "INTENDED_USER_EXIT": (False, "closed"),  # it exited on purpose (exit_actor, sys.exit)
    # crashed or killed: lost
    **dict.fromkeys(LOST_RAY_EXITS, (False, "running")),
}


# ------------------------------------------------------------------ derived batches


class _Lookups:
    """Node IPs and worker pids of a session, for worker labels (cached per process: a
    node's IP and a worker's pid never change)."""

    _cache: dict[tuple[str, int, str], Any] = {}

    @classmethod
    def _get(
        cls, db: Session, session_id: int, ids: Iterable[str | None], key: Any, value: Any
    ) -> dict[str, Any]:
        table = key.class_.__tablename__
        want = {i for i in ids if i}
        out = {
            i: cls._cache[(table, session_id, i)]
            for i in want
            if (table, session_id, i) in cls._cache
        }
        missing = want - set(out)
        if missing:
            rows = db.execute(
                select(key, value).where(
                    key.class_.session_id == session_id, key.in_(missing), value.is_not(None)
                )
            )
            for i, v in rows:
                out[i] = v
                if len(cls._cache) > 200_000:
                    cls._cache.clear()
                cls._cache[(table, session_id, i)] = v
        return out

    @classmethod
    def ips(cls, db: Session, session_id: int, nodes: Iterable[str | None]) -> dict[str, str]:
        return cls._get(db, session_id, nodes, m.RayNode.node_id, m.RayNode.ip)

    @classmethod
    def pids(cls, db: Session, session_id: int, workers: Iterable[str | None]) -> dict[str, int]:
        return cls._get(db, session_id, workers, m.RayWorker.worker_id, m.RayWorker.pid)


@functools.lru_cache(maxsize=8)
def _row_type(fields: tuple[str, ...]) -> Any:
    return collections.namedtuple("RayTaskRow", fields)


def tasks_as_events(db: Session, session_id: int, rows: list[Any]) -> list[TaskEvent]:
    if rows and hasattr(rows[0], "_fields"):
        # Plain tuples: a Row's attribute costs ~5x a namedtuple's, and task_event reads ~30.
        make = _row_type(tuple(rows[0]._fields))._make
        rows = [make(r) for r in rows]
    undefined = [r.task_id for r in rows if not r.defined]
    if undefined:
        rows = _borrow_definitions(db, session_id, rows, undefined)
    pids = _Lookups.pids(db, session_id, (r.worker_id for r in rows if not r.pid))
    ips = _Lookups.ips(db, session_id, (r.node_id for r in rows))
    return [task_event(r, ips.get(r.node_id or ""), pids.get(r.worker_id or "")) for r in rows]


#: What an attempt whose definition never came takes from another attempt of its task
#: (not its job: the run's counts select tasks by their own row's job).
_DEFINED = ("name", "func", "module", "task_type", "parent_id", "actor_id")


def _borrow_definitions(
    db: Session, session_id: int, rows: list[Any], task_ids: list[str]
) -> list[Any]:
    """Rows whose definition never came, named from another attempt of the same task (Ray
    sends a restarted actor's creation task's later attempt as a RUNNING alone). They keep
    ``defined`` false: ``attrs.defined`` still says the definition of this attempt never came."""
    T = m.RayTask
    known: dict[str, Any] = {}
    for chunk in _chunks(sorted(set(task_ids))):
        q = (
            select(T.task_id, *(getattr(T, c) for c in _DEFINED))
            .where(T.session_id == session_id, T.task_id.in_(chunk), T.defined.is_(True))
            .order_by(T.task_id, T.attempt)  # the first attempt defined
        )
        for r in db.execute(q):
            known.setdefault(r.task_id, r)
    out = []
    for r in rows:
        d = known.get(r.task_id) if not r.defined else None
        if d is not None:
            r = r._replace(**{c: getattr(r, c) or getattr(d, c) for c in _DEFINED})
        out.append(r)
    return out


@dataclass
class Derived:
    """Protocol records derived from one merge, to be indexed as one batch."""

    tasks: list[TaskEvent] = field(default_factory=list)
    runs: list[RunEvent] = field(default_factory=list)
    workers: list[WorkerEvent] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tasks or self.runs or self.workers)


def _valid(batch: Batch) -> Batch:
    """The batch as readers will decode it; events the protocol cannot hold are dropped
    (logged), so one odd value never blocks a node's exporter."""
    try:
        return decode_batch(encode_batch(batch))
    except SchemaError as exc:
        logger.error("derived Ray batch failed validation (%s); dropping the events that fail", exc)
    good = []
    for ev in batch.events:
        probe = msgspec.structs.replace(batch, events=[ev])
        try:
            decode_batch(encode_batch(probe))
            good.append(ev)
        except SchemaError as exc:
            logger.error("dropping a derived Ray event: %s: %r", exc, ev)
    return decode_batch(encode_batch(msgspec.structs.replace(batch, events=good)))


def write_derived(
    db: Session,
    blobs: BlobStore,
    *,
    tenant_id: int,
    tenant: str,
    cluster: str,
    session: str,
    derived: Derived,
    now: float,
    cache: IdCache | None = None,
) -> str | None:
    """Store the derived records as one protocol batch (named by its content) and index it
    with the ordinary writer. Returns the blob key, None if there was nothing to write."""
    if not derived:
        return None
    started = session_started(session)
    events: list[Any] = []
    if started is not None:
        events.append(
            SessionEvent(time=started, config={"scheduler": "ray", "ray_session": session})
        )
    events += sorted(derived.runs, key=lambda e: (e.id, e.event, e.time))
    events += sorted(derived.workers, key=lambda e: (e.address, e.event, e.time))
    events += sorted(derived.tasks, key=lambda e: (e.key, e.attrs.get("attempt", 0)))
    body = msgspec.json.encode(events)
    seq = int(hashlib.sha256(body).hexdigest()[:13], 16)
    batch = Batch(schema=1, cluster=cluster, session=session, agent=AGENT, seq=seq, events=events)
    # encode_batch(batch), byte for byte, without encoding the events a second time (the
    # second encoding was ~4% of a collector's CPU under Ray ingest): events is the last
    # field a derived batch has.
    head = encode_batch(msgspec.structs.replace(batch, events=[]))
    assert head.endswith(b'"events":[]}')
    data = zstandard.ZstdCompressor(level=STORE_LEVEL).compress(head[:-3] + body + b"}")
    key = derived_key(tenant, cluster, session, seq)
    if not blobs.put(key, data, if_absent=True):
        data = blobs.get(key)  # index what is stored (the same content, by its name)
    index_batch(
        db,
        tenant_id=tenant_id,
        tenant=tenant,
        batch=batch,
        blob_key=key,
        size=len(data),
        now=now,
        cache=cache,
    )
    return key


# ------------------------------------------------------------------ merging a body


class _Touches:
    """When this process last refreshed each job's ``last_event_at`` (at most every 5 s:
    the job row is otherwise left unlocked for concurrent bodies of the same job)."""

    _at: dict[tuple[str, int, str], float] = {}

    @classmethod
    def due(cls, db: Session, session_id: int, job: str, now: float) -> bool:
        key = (str(db.get_bind().url), session_id, job)
        if now - cls._at.get(key, 0.0) < 5.0:
            return False
        if len(cls._at) > 100_000:
            cls._at.clear()
        cls._at[key] = now
        return True


@dataclass
class PartResult:
    session: str
    duplicate: bool
    events: int
    skipped: dict[str, int]
    emitted: int = 0
    derived_key: str | None = None
    session_id: int | None = None
    body_id: int | None = None
    # The body's task patches, not merged: for the caller's TaskHold (``hold=True``).
    held: list[TaskPatch] | None = None


class Merged(NamedTuple):
    cluster_id: int
    session_id: int
    job_rows: list[Any]
    worker_rows: list[Any]
    body_id: int
    held: list[TaskPatch] | None  # the task patches left to the caller (``hold=True``)


def _chunks(items: list[Any], n: int = _CHUNK) -> Iterable[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def merge_part(
    db: Session,
    *,
    tenant_id: int,
    cluster: str,
    stored: StoredPart,
    key: str,
    now: float,
    cache: IdCache | None = None,
    hold: bool = False,
) -> Merged | None:
    """Merge one stored part into the tables and queue (``ray_ready``) the tasks it
    completes; None if this body was merged before. Order: the manifest, then nodes,
    workers, actors, jobs, tasks, each in key order, so concurrent merges lock rows alike.
    ``cache`` (the writer's, see ``storage.core.idcache``) spares the cluster and session
    look-ups once this process has written the session's records. ``hold`` (Postgres): the
    task patches are returned instead of merged, for a :class:`TaskHold`, and the manifest
    row says so (``tasks_merged`` false)."""
    st = _stmts(db)
    part = stored.part
    held = hold and st.task_bulk is not None and bool(part.tasks)
    body = {
        "sha": stored.sha,
        "blob_key": key,
        "events": len(part.raw),
        "bytes": len(stored.data),
        "received_at": now,
        "tasks_merged": not held,
    }
    body_id = None
    cached = cache.get((tenant_id, cluster, part.session, AGENT)) if cache else None
    if cached is not None:
        cluster_id, session_id = cached[0], cached[1]
        body_id = db.execute(
            st.body_guarded,
            {
                **body,
                "session_id": session_id,
                "p_session": part.session,
                "p_cluster_id": cluster_id,
                "p_cluster": cluster,
                "p_tenant_id": tenant_id,
            },
        ).scalar()
    if body_id is None:
        cluster_id, session_id = ensure_session(db, tenant_id, cluster, part.session, now)
        body_id = db.execute(st.body, {**body, "session_id": session_id}).scalar()
    if body_id is None:
        return None
    sid = session_id
    if part.nodes:
        db.execute(
            st.node,
            [
                {
                    "session_id": sid,
                    "node_id": k,
                    "ip": n.ip,
                    "hostname": n.hostname,
                    "name": n.name,
                    "started_at": n.started_at,
                    "alive_at": n.alive_at,
                    "dead_at": n.dead_at,
                    "death_reason": n.death_reason,
                    "resources": n.resources,
                }
                for k, n in sorted(part.nodes.items())
            ],
        )
    workers = []
    for k, w in sorted(part.workers.items()):
        workers += db.execute(
            st.worker,
            {
                "session_id": sid,
                "worker_id": k,
                "node_id": w.node,
                "pid": w.pid,
                "worker_type": w.worker_type,
                "job_id": w.job,
                "started_at": w.started_at,
                "ended_at": w.ended_at,
                "exit_type": w.exit_type,
                "exit_detail": w.exit_detail,
            },
        ).all()
    if part.actors:
        db.execute(
            st.actor,
            [
                {
                    "session_id": sid,
                    "actor_id": k,
                    "job_id": a.job,
                    "class_name": a.class_name,
                    "name": a.name,
                    "node_id": a.node,
                    "worker_id": a.worker,
                    "pid": a.pid,
                    "alive_at": a.alive_at,
                    "dead_at": a.dead_at,
                }
                for k, a in sorted(part.actors.items())
            ],
        )
    jobs = set(part.jobs) | {t.job_id for t in part.tasks.values() if t.job_id}
    job_rows = []
    for job in sorted(jobs):
        j = part.jobs.get(job)
        patched = j is not None and any(
            v is not None
            for v in (j.entrypoint, j.driver_pid, j.created_at, j.finished_at, j.driver_exit_at)
        )
        if not patched and not _Touches.due(db, sid, job, now):
            continue
        ended = j is not None and (j.finished_at is not None or j.driver_exit_at is not None)
        job_rows += db.execute(
            st.job,
            {
                "session_id": sid,
                "job_id": job,
                "entrypoint": j.entrypoint if j else None,
                "driver_pid": j.driver_pid if j else None,
                "driver_node": j.driver_node if j else None,
                "created_at": j.created_at if j else None,
                "finished_at": j.finished_at if j else None,
                "driver_exit_at": j.driver_exit_at if j else None,
                "end_seen": now if ended else None,
                "last_event_at": now,
                "closed_at": None,
                "closed_by": None,
            },
        ).all()
    patches = None
    if held:
        patches = list(part.tasks.values())
    elif part.tasks:
        patches = [t for _, t in sorted(part.tasks.items())]
        if st.task_bulk is not None:  # merges, and queues what it completes (see _statements)
            _merge_patches(db, sid, patches, now)
        else:
            rows = [{f: getattr(t, f) for f in t.__struct_fields__} for t in patches]
            for r in rows:
                r.update(
                    session_id=sid,
                    first_seen=now,
                    emitted=False,
                    end_seen=(
                        now if r["finished_at"] is not None or r["failed_at"] is not None else None
                    ),
                )
            db.execute(st.task, rows)
            for chunk in _chunks(sorted(part.tasks)):
                _enqueue(
                    db, sid, db.execute(st.emit_complete, {"p_session": sid, "p_keys": chunk}).all()
                )
    known = [n for n, patch in sorted(part.nodes.items()) if patch.ip]
    if known:
        # Tasks that were complete but for their node's IP (rows held by a concurrent merge
        # are left to it or to the sweeper).
        _enqueue(db, sid, _emit_locked(db, sid, [m.RayTask.node_id.in_(known), *st.complete]))
    counts = [
        {"session_id": sid, "kind": kind, "event_type": etype, "count": n}
        for kind, d in (("received", part.received), ("skipped", part.skipped))
        for etype, n in sorted(d.items())
    ]
    if counts:
        db.execute(st.counts, counts)
    return Merged(cluster_id, sid, job_rows, workers, body_id, patches if held else None)


def index_part(
    db: Session,
    blobs: BlobStore,
    *,
    tenant_id: int,
    tenant: str,
    cluster: str,
    stored: StoredPart,
    now: float,
    emit: bool = True,
    defer_tasks: bool = False,
    cache: IdCache | None = None,
    hold: bool = False,
) -> PartResult:
    """Merge one stored part and write what became complete. The caller has stored the
    raw part (``raw_key``) and owns the transaction. With ``emit=False`` (reindex's first
    pass) only the merge tables change (complete tasks are queued). With ``defer_tasks``
    the queued tasks are left for :func:`emit_ready` (a collector with a sweeper): the
    body's job starts and workers are still written here. With ``hold`` the body's task
    patches are not merged but returned (``held``) for the caller's :class:`TaskHold`, to
    be added to it once this transaction commits."""
    part = stored.part
    result = PartResult(part.session, False, len(part.raw), dict(part.skipped))
    if part.session == NO_SESSION:
        return result  # stored and counted by the caller; nothing to index
    key = raw_key(tenant, cluster, part.session, stored.sha)
    merged = merge_part(
        db,
        tenant_id=tenant_id,
        cluster=cluster,
        stored=stored,
        key=key,
        now=now,
        cache=cache,
        hold=hold,
    )
    if merged is None:
        result.duplicate = True
        return result
    sid, job_rows, worker_rows = merged.session_id, merged.job_rows, merged.worker_rows
    result.session_id, result.body_id, result.held = sid, merged.body_id, merged.held
    if not emit:
        return result
    derived = Derived()
    rows = [] if defer_tasks else take_ready(db, sid)
    derived.tasks = tasks_as_events(db, sid, rows)
    derived.runs = [e for e in (job_started(j) for j in job_rows) if e is not None]
    derived.workers = workers_of(db, sid, worker_rows, stored.part.nodes)
    result.emitted = len(derived.tasks)
    result.derived_key = write_derived(
        db,
        blobs,
        tenant_id=tenant_id,
        tenant=tenant,
        cluster=cluster,
        session=part.session,
        derived=derived,
        now=now,
        cache=cache,
    )
    return result


def workers_of(
    db: Session, session_id: int, rows: list[Any], nodes: Iterable[str]
) -> list[WorkerEvent]:
    """Worker events for the merged worker rows, and for the workers of nodes whose IP just
    became known (their labels need it)."""
    by_id = {r.worker_id: r for r in rows}
    nodes = list(nodes)
    if nodes:
        W = m.RayWorker
        for r in db.execute(
            select(W).where(W.session_id == session_id, W.node_id.in_(nodes))
        ).scalars():
            by_id.setdefault(r.worker_id, r)
    if not by_id:
        return []
    ips = _Lookups.ips(db, session_id, (r.node_id for r in by_id.values()))
    out = []
    for r in by_id.values():
        out += worker_events(r, ips.get(r.node_id or ""))
    return out


# ------------------------------------------------------------------ the sweeper


@dataclass
class SweepCounts:
    tasks: int = 0
    jobs_closed: int = 0
    batches: int = 0
    failed: int = 0  # sessions whose work failed (left for a later pass)

    def add(self, other: SweepCounts) -> None:
        self.tasks += other.tasks
        self.jobs_closed += other.jobs_closed
        self.batches += other.batches
        self.failed += other.failed


def _session_names(db: Session, session_id: int) -> tuple[int, str, str, str]:
    """(tenant id, tenant, cluster, session) of a session id."""
    row = db.execute(
        select(m.Tenant.id, m.Tenant.name, m.Cluster.name, m.Session.name)
        .join(m.Cluster, m.Cluster.tenant_id == m.Tenant.id)
        .join(m.Session, m.Session.cluster_id == m.Cluster.id)
        .where(m.Session.id == session_id)
    ).one()
    return row[0], row[1], row[2], row[3]


def _emit_locked(
    db: Session, session_id: int, where: list[Any], limit: int | None = None
) -> list[Any]:
    """Emit the unemitted tasks of a session matching ``where`` (at most ``limit``) that no
    other transaction holds: lock them with SKIP LOCKED (never wait, so never deadlock with
    a merge), then flip exactly those."""
    T = m.RayTask
    q = select(T.task_id, T.attempt).where(T.session_id == session_id, T.emitted.is_(False), *where)
    if limit is not None:
        q = q.limit(limit)
    st = _stmts(db)
    if st.dialect == "postgresql":
        # One statement: the keys never travel to this process and back.
        taken = tuple_(T.task_id, T.attempt).in_(q.with_for_update(skip_locked=True))
        flip = update(T.__table__).where(T.session_id == session_id, taken).values(emitted=True)
        return db.execute(flip.returning(*T.__table__.c)).all()
    keys = [(t, a) for t, a in db.execute(q)]
    rows: list[Any] = []
    for chunk in _chunks(keys):
        rows += db.execute(st.emit_keys, {"p_session": session_id, "p_keys": chunk}).all()
    return rows


def _enqueue(db: Session, session_id: int, rows: list[Any]) -> None:
    """Queue tasks just taken for writing (``emitted`` flipped) in ``ray_ready``."""
    if rows:
        db.execute(
            _stmts(db).ready,
            [
                {
                    "session_id": session_id,
                    "task_id": r.task_id,
                    "attempt": r.attempt,
                    "job_id": r.job_id,
                }
                for r in rows
            ],
        )


def take_ready(
    db: Session, session_id: int, *, job: str | None = None, limit: int | None = None
) -> list[Any]:
    """Take queued tasks of a session (of one job; at most ``limit``) out of ``ray_ready``
    for writing in this transaction: their ``ray_tasks`` rows as they are now. Queue rows
    another transaction holds are left to it (SKIP LOCKED)."""
    R, T = m.RayReady.__table__, m.RayTask.__table__  # Core: the ORM's bulk DELETE costs
    q = select(R.c.task_id, R.c.attempt).where(R.c.session_id == session_id)
    if job is not None:
        q = q.where(R.c.job_id == job)
    if limit is not None:
        q = q.limit(limit)
    taken = (
        delete(R)
        .where(
            R.c.session_id == session_id, tuple_(R.c.task_id, R.c.attempt).in_(_skip_locked(q, db))
        )
        .returning(R.c.task_id, R.c.attempt)
    )
    st = _stmts(db)
    if st.dialect == "postgresql":
        # One statement: the keys never travel to this process and back. One primary-key
        # lookup per key whatever the statistics say: joined plainly, a planner that had
        # not yet seen the table grow hashed all of the session's rows for 2,000 keys
        # (277 ms, spilling to disk, against 12 ms); LIMIT 1 keeps the lateral lookup from
        # being flattened into that join.
        d = taken.cte("d")
        one = (
            select(*T.c)
            .where(
                T.c.session_id == session_id, T.c.task_id == d.c.task_id, T.c.attempt == d.c.attempt
            )
            .limit(1)
            .lateral("t")
        )
        return db.execute(select(*one.c).select_from(d).join(one, true())).all()
    keys = db.execute(taken).all()
    rows: list[Any] = []
    for chunk in _chunks(sorted((k.task_id, k.attempt) for k in keys)):
        rows += db.execute(st.rows, {"p_session": session_id, "p_keys": chunk}).all()
    return rows


def _sweep_session(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    session_id: int,
    where: list[Any] | None,
    now: float,
    cache: IdCache | None,
    limit: int | None = None,
) -> SweepCounts:
    """Write a session's tasks: those matching ``where`` not yet taken, or (``where`` None)
    those the merges queued."""
    out = SweepCounts()
    with sessions.begin() as db:
        if where is None:
            rows = take_ready(db, session_id, limit=limit)
        else:
            rows = _emit_locked(db, session_id, where, limit)
        if rows:
            out.batches += _write_tasks(db, blobs, session_id, rows, now, cache)
            out.tasks += len(rows)
    return out


def _write_tasks(
    db: Session,
    blobs: BlobStore,
    session_id: int,
    rows: list[Any],
    now: float,
    cache: IdCache | None,
    batch: int | None = None,
) -> int:
    """Write taken ``ray_tasks`` rows as derived batches of at most ``batch`` tasks (one
    batch if None); returns how many batches."""
    tenant_id, tenant, cluster, session = _session_names(db, session_id)
    parts = list(_chunks(rows, batch)) if batch else [rows]
    for part in parts:
        write_derived(
            db,
            blobs,
            tenant_id=tenant_id,
            tenant=tenant,
            cluster=cluster,
            session=session,
            derived=Derived(tasks=tasks_as_events(db, session_id, part)),
            now=now,
            cache=cache,
        )
    return len(parts)


def _close_job(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    session_id: int,
    job_id: str,
    now: float,
    settle: float,
    idle: float,
    cache: IdCache | None,
) -> SweepCounts:
    out = SweepCounts()
    J, T = m.RayJob, m.RayTask
    with sessions.begin() as db:
        job = db.execute(
            _skip_locked(select(J).where(J.session_id == session_id, J.job_id == job_id), db)
        ).scalar_one_or_none()
        if job is None:
            return out
        ended = job.end_seen is not None and job.end_seen <= now - settle
        if job.closed_at is not None:
            # Closed when idle or at the driver's exit, then Ray's FINISHED came: the run
            # ends at it (it kept the earlier end, before tasks that ran after it).
            if job.closed_by == "finished" or job.finished_at is None or not ended:
                return out
        elif not ended and job.last_event_at > now - idle:
            return out
        again = job.closed_at is not None
        job_end = next((t for t in (job.finished_at, job.driver_exit_at) if _time_ok(t)), None)
        if (
            not again
            and ended
            and job_end is not None
            and job.end_seen > now - settle - WORKER_DEATH_WINDOW_S
            and _awaits_worker_death(db, session_id, job_id)
        ):
            return out
        rows: list[Any] = []
        if not again:
            # Closing again writes the end alone: tasks that came since the first close
            # settle as stragglers (written here at once, a task still waiting for its
            # node's address was named after its worker id: seen in CI).
            rows = take_ready(db, session_id, job=job_id)
            rows += _emit_locked(db, session_id, [T.job_id == job_id])
        end = db.execute(
            select(func.max(func.coalesce(T.failed_at, T.finished_at))).where(
                T.session_id == session_id, T.job_id == job_id
            )
        ).scalar()
        finished = next(
            (t for t in (job.finished_at, job.driver_exit_at, end, job.created_at) if _time_ok(t)),
            None,
        )
        if job_end is not None and not again:
            rows = failed_with_job(rows, job_id, job_end, _workers_died(db, session_id, rows))
            job.unended_failed_at = now
        tenant_id, tenant, cluster, session = _session_names(db, session_id)
        derived = Derived(tasks=tasks_as_events(db, session_id, rows))
        started = job_started(job)
        if started is not None:
            derived.runs.append(started)
        if finished is not None:
            derived.runs.append(RunEvent(event="finished", id=job_id, time=finished))
        if write_derived(
            db,
            blobs,
            tenant_id=tenant_id,
            tenant=tenant,
            cluster=cluster,
            session=session,
            derived=derived,
            now=now,
            cache=cache,
        ):
            out.batches += 1
        job.closed_at = now
        job.closed_by = (
            "finished"
            if job.finished_at is not None
            else "driver_exit"
            if job.driver_exit_at is not None
            else "idle"
        )
        out.tasks += len(rows)
        out.jobs_closed += 0 if again else 1
    return out


#: How long after its job's end a worker's death still ends the task it was running, as
#: Ray's GCS decides it: it fails a finished job's unended tasks at the job's end
#: ``gcs_mark_task_failed_on_job_done_delay_ms`` (15 s) after it, and a dead worker's at
#: the worker's death ``gcs_mark_task_failed_on_worker_dead_delay_ms`` (1 s) after that;
#: whichever comes first wins. (A call running on a detached actor, which outlives its
#: job, ends when the actor dies within 14 s, else at the job's end.)
WORKER_DEATH_WINDOW_S = 15.0 - 1.0


#: Ray's ``WorkerExitType`` numbers, as its State API prints them in a task's error.
_EXIT_CODES = {
    "SYSTEM_ERROR": 0,
    "INTENDED_SYSTEM_EXIT": 1,
    "USER_ERROR": 2,
    "INTENDED_USER_EXIT": 3,
    "NODE_OUT_OF_MEMORY": 4,
}


def _unended_running(r: Any) -> bool:
    return r.finished_at is None and r.failed_at is None and r.running_at is not None


class _Died(NamedTuple):
    worker_id: str
    pid: int | None
    started_at: float | None
    ended_at: float
    exit_type: str | None
    exit_detail: str | None


def _workers_died(db: Session, session_id: int, rows: list[Any]) -> list[_Died]:
    """The workers that may have run the rows' unended RUNNING tasks (by the worker id the
    owner sent, or the pid the executing worker did), those whose end has arrived."""
    running = [r for r in rows if _unended_running(r)]
    ids = sorted({r.worker_id for r in running if r.worker_id})
    pids = sorted({r.pid for r in running if r.pid})
    if not ids and not pids:
        return []
    W = m.RayWorker
    got = db.execute(
        select(W.worker_id, W.pid, W.started_at, W.ended_at, W.exit_type, W.exit_detail).where(
            W.session_id == session_id,
            W.ended_at.is_not(None),
            or_(W.worker_id.in_(ids), W.pid.in_(pids)),
        )
    )
    return [_Died(*row) for row in got]


def _awaits_worker_death(db: Session, session_id: int, job_id: str) -> bool:
    """A task of the job was RUNNING, has not ended and its worker's death has not come:
    its end is that death if it comes within ``WORKER_DEATH_WINDOW_S`` of the job's end
    (a detached actor's worker outlives the job; the job's own workers die in ms). The
    close waits for it, so that the live index and a rebuild from the bodies, which knows
    every death, end the task alike."""
    T = m.RayTask
    running = db.execute(
        select(T.worker_id, T.pid, T.running_at, T.finished_at, T.failed_at).where(
            T.session_id == session_id,
            T.job_id == job_id,
            T.emitted.is_(False),
            T.defined.is_(True),
            T.running_at.is_not(None),
            T.finished_at.is_(None),
            T.failed_at.is_(None),
        )
    ).all()
    if not running:
        return False
    died = _workers_died(db, session_id, running)
    return any(_died_running(r, died) is None for r in running)


def _died_running(r: Any, died: list[_Died]) -> _Died | None:
    """The worker that ran ``r`` and died after it started: the one the owner named, else
    the one of its pid alive when it started."""
    for w in died:
        if r.worker_id and w.worker_id == r.worker_id:
            return w if w.ended_at >= r.running_at else None
    for w in died:
        if (
            r.pid
            and w.pid == r.pid
            and w.ended_at >= r.running_at
            and (w.started_at is None or w.started_at <= r.running_at)
        ):
            return w
    return None


def failed_with_job(
    rows: list[Any], job_id: str, end: float, died: list[_Died] | None = None
) -> list[Any]:
    """Ray's rule for a job's end, applied to the tasks written with it: a task that had
    not ended when its job did (its driver exited: pending, or running in a worker Ray then
    kills) is FAILED, ``WORKER_DIED``. Ray's GCS marks them so in its State API and sends
    no event for it; they read ``lost`` with no error (found by a held-out check: a driver
    exiting with 20 tasks unfinished gave a run without errors, where Ray listed 20
    failures). A task that was RUNNING ends when its worker died (``died``: the workers'
    ends, as Ray sends them; Ray force-exits them a few ms after the job), with Ray's
    message for it, if that was within ``WORKER_DEATH_WINDOW_S`` of the job's end; any
    other, or one whose worker's end has not come, at the job's end.
    Attempts whose definition never came (a restarted actor's creation task: Ray's State
    API does not list them) stay ``lost``."""
    out = []
    for r in rows:
        if r.finished_at is None and r.failed_at is None and r.defined:
            if not hasattr(r, "_replace"):
                r = _row_type(tuple(r._fields))._make(r)
            w = _died_running(r, died) if died and _unended_running(r) else None
            if w is not None and _time_ok(w.ended_at) and w.ended_at <= end + WORKER_DEATH_WINDOW_S:
                at, kind = w.ended_at, w.exit_type
                message = (
                    f"Worker running the task ({w.worker_id}) died with exit_type: "
                    f"{_EXIT_CODES.get(kind or '', kind)} with error_message: "
                    f"{w.exit_detail or ''}"
                )
            else:
                at = end
                message = (
                    f"Job finishes ({job_id}) as driver exits. Marking all non-terminal "
                    "tasks as failed."
                )
            r = r._replace(
                failed_at=at,
                error_type=r.error_type or "WORKER_DIED",
                error_message=r.error_message or message,
            )
        out.append(r)
    return out


class _Quarantine:
    """Sessions whose sweep failed, each left alone for a while (doubling up to
    ``MAX_DELAY``), so that one session that cannot be written (its blob prefix refused, a
    row the writer chokes on) never holds up the others' tasks and jobs. Per process, per
    index (session ids are the index's)."""

    FIRST_DELAY = 1.0
    MAX_DELAY = 60.0

    def __init__(self) -> None:
        # (index, session id) -> (monotonic time it may be tried again, its last delay)
        self._until: dict[tuple[str, int], tuple[float, float]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _index(sessions: sessionmaker[Session]) -> str:
        bind = sessions.kw.get("bind")
        return str(getattr(bind, "url", bind))

    def ready(self, sessions: sessionmaker[Session], sids: Iterable[int], now: float) -> list[int]:
        index = self._index(sessions)
        with self._lock:
            return [s for s in sids if self._until.get((index, s), (0.0, 0.0))[0] <= now]

    def waiting(self, sessions: sessionmaker[Session], now: float) -> list[int]:
        """The sessions of this index left alone at ``now``."""
        index = self._index(sessions)
        with self._lock:
            return sorted(
                s for (i, s), (until, _) in self._until.items() if i == index and until > now
            )

    def run(
        self, sessions: sessionmaker[Session], sid: int, what: str, fn: Callable[[], SweepCounts]
    ) -> SweepCounts:
        key = (self._index(sessions), sid)
        try:
            got = fn()
        except Exception:
            with self._lock:
                last = self._until.get(key, (0.0, self.FIRST_DELAY / 2))[1]
                delay = min(self.MAX_DELAY, last * 2)
                self._until[key] = (time.monotonic() + delay, delay)
            logger.warning(
                "Ray sweeper: %s failed for session %s; the other sessions go on, "
                "this one is tried again in %.0f s",
                what,
                sid,
                delay,
                exc_info=True,
            )
            return SweepCounts(failed=1)
        if key in self._until:
            with self._lock:
                self._until.pop(key, None)
        return got


_quarantine = _Quarantine()
# A session whose held patches could not be merged and written: its next flushes leave
# their patches to recovery for a while (kept apart from the sweeps' pauses: a flush that
# succeeds must not cut short the pause of a sweep that keeps failing).
_flush_pause = _Quarantine()


def run_due(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    *,
    settle: float,
    idle: float,
    now: float | None = None,
    cache: IdCache | None = None,
    limit: int = 100,
) -> SweepCounts:
    """One pass of the sweeper: emit tasks whose end was seen ``settle`` seconds ago (RUNNING
    or the definition never came), close jobs ``settle`` seconds after their end or ``idle``
    seconds after their last event, and emit stragglers of closed jobs. Safe to run in
    several processes at once (rows are taken with SKIP LOCKED; a task flips once)."""
    now = time.time() if now is None else now
    cutoff = now - settle
    out = SweepCounts()
    J, T, B = m.RayJob, m.RayTask, m.RayBody
    with sessions() as db:
        # Bodies whose task patches a collector holds, or held and died (merged within
        # ~0.5 s, or by recover_held): what a job's or a task's settle time waited for
        # includes every body acknowledged in it, so nothing is written or closed while
        # one of those is not merged (a task whose end is held would be written without
        # it, lost or failed with its job, for good). Per session, the oldest.
        held = dict(
            db.execute(
                select(B.session_id, func.min(B.received_at))
                .where(B.tasks_merged.is_(False))
                .group_by(B.session_id)
            ).all()
        )
        stale = db.scalars(
            select(T.session_id)
            .where(T.emitted.is_(False), T.end_seen <= cutoff)
            .distinct()
            .limit(limit)
        ).all()
        closing = db.execute(
            select(J.session_id, J.job_id, J.end_seen, J.last_event_at)
            .where(J.closed_at.is_(None), or_(J.end_seen <= cutoff, J.last_event_at <= now - idle))
            .limit(limit)
        ).all()
        closing += db.execute(  # closed before Ray's FINISHED came
            select(J.session_id, J.job_id, J.end_seen, J.last_event_at)
            .where(
                J.closed_at.is_not(None),
                J.closed_by != "finished",
                J.finished_at.is_not(None),
                J.end_seen <= cutoff,
            )
            .limit(limit)
        ).all()
        stragglers = db.scalars(
            select(T.session_id)
            .join(J, (J.session_id == T.session_id) & (J.job_id == T.job_id))
            .where(T.emitted.is_(False), J.closed_at.is_not(None), T.first_seen <= cutoff)
            .distinct()
            .limit(limit)
        ).all()

    def settled(sid: int) -> float:
        """Tasks first or last seen by then have had their settle time without a held
        body arriving in it."""
        return cutoff if sid not in held else min(cutoff, held[sid] - settle)

    def waits(sid: int, end_seen: float | None, last_event_at: float | None) -> bool:
        """A held body came within the time the job's close waited for."""
        if sid not in held:
            return False
        ends = end_seen + settle if end_seen is not None and end_seen <= cutoff else None
        deadline = ends if ends is not None else (last_event_at or 0.0) + idle
        return held[sid] <= deadline

    closing = [(sid, job) for sid, job, end, last in closing if not waits(sid, end, last)]
    q, mono = _quarantine, time.monotonic()
    for sid in q.ready(sessions, stale, mono):
        out.add(
            q.run(
                sessions,
                sid,
                "writing settled tasks",
                lambda sid=sid: _sweep_session(
                    sessions, blobs, sid, [T.end_seen <= settled(sid)], now, cache
                ),
            )
        )
    for sid, job in closing:
        if q.ready(sessions, [sid], mono):
            out.add(
                q.run(
                    sessions,
                    sid,
                    f"closing job {job}",
                    lambda sid=sid, job=job: _close_job(
                        sessions, blobs, sid, job, now, settle, idle, cache
                    ),
                )
            )
    for sid in q.ready(sessions, stragglers, mono):
        closed = select(J.job_id).where(J.session_id == sid, J.closed_at.is_not(None))
        out.add(
            q.run(
                sessions,
                sid,
                "writing late tasks",
                lambda sid=sid, closed=closed: _sweep_session(
                    sessions,
                    blobs,
                    sid,
                    [T.job_id.in_(closed), T.first_seen <= settled(sid)],
                    now,
                    cache,
                ),
            )
        )
    return out


def emit_ready(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    *,
    now: float | None = None,
    cache: IdCache | None = None,
    limit: int = 100,
    batch: int = 20_000,
) -> SweepCounts:
    """Write the complete tasks the merges queued (``ray_ready``: defined, RUNNING, ended,
    their node's IP known), one derived batch per session and pass (of at most ``batch``
    tasks): what the merges of ``index_part(defer_tasks=True)`` left. Many bodies' tasks
    then share one blob and one pass of the writer. Safe in several processes at once
    (SKIP LOCKED)."""
    now = time.time() if now is None else now
    out = SweepCounts()
    R = m.RayReady
    with sessions() as db:
        sids = db.scalars(select(R.session_id).distinct().limit(limit)).all()
    for sid in _quarantine.ready(sessions, sids, time.monotonic()):
        while True:
            got = _quarantine.run(
                sessions,
                sid,
                "writing complete tasks",
                lambda sid=sid: _sweep_session(sessions, blobs, sid, None, now, cache, batch),
            )
            out.add(got)
            if got.failed or got.tasks < batch:
                break
    return out


def has_open_work(db: Session) -> bool:
    """Whether anything is left for the sweeper (an open job, a job closed before its
    FINISHED came, a body whose tasks are not merged yet, an unemitted task)."""
    J, T, R, B = m.RayJob, m.RayTask, m.RayReady, m.RayBody
    reclose = and_(J.closed_by != "finished", J.finished_at.is_not(None))
    return (
        db.scalar(select(J.job_id).where(or_(J.closed_at.is_(None), reclose)).limit(1)) is not None
        or db.scalar(select(B.id).where(B.tasks_merged.is_(False)).limit(1)) is not None
        or db.scalar(select(R.task_id).limit(1)) is not None
        or db.scalar(select(T.task_id).where(T.emitted.is_(False)).limit(1)) is not None
    )


# ------------------------------------------------------------------ held task patches


def _fold(into: TaskPatch, p: TaskPatch) -> None:
    """Merge patch ``p`` into ``into`` as the merge statement merges a patch into a row:
    a value set once stays, times keep the earliest, ``defined`` is OR-ed."""
    for f in _TASK_FIRST:
        if getattr(into, f) is None:
            v = getattr(p, f)
            if v is not None:
                setattr(into, f, v)
    for f in _TASK_LOW:
        v = getattr(p, f)
        if v is not None:
            old = getattr(into, f)
            if old is None or v < old:
                setattr(into, f, v)
    if p.defined:
        into.defined = True


def _complete(p: TaskPatch) -> bool:
    return (
        p.defined
        and p.running_at is not None
        and (p.finished_at is not None or p.failed_at is not None)
    )


class _Held(msgspec.Struct, gc=False):
    """A held patch, when it came, and the bodies it folds. Untracked by the cyclic garbage
    collector (it holds a patch, a float and ints, so it cannot be part of a cycle): tens
    of thousands live for a moment under load, and as tracked objects they made each full
    collection of a collector process cost ~50 ms (~13% of its CPU under the bench)."""

    patch: TaskPatch
    since: float
    bodies: tuple[int, ...]


class TaskHold:
    """Task patches of acknowledged bodies, held in this process for a moment before they
    are merged into ``ray_tasks`` (a Postgres collector with a sweeper; the sweeper's
    thread flushes, and requests too when it falls behind). Ray sends a task's definition
    and RUNNING in one body of a node's aggregator and its end in a later one: held
    together they become one row write instead of an insert and an update, and one patch
    to read and encode instead of two (a sixth more events a second through the same two
    cores, bench/ray_ingest.py).

    A patch is merged once its task is complete in the hold (defined, RUNNING and ended)
    or ``age`` seconds after it came, whichever is first. Nothing acknowledged depends on
    this process living: the body is stored before the ack, and its manifest row
    (``ray_bodies.tasks_merged`` false) stays so until the flush that merges its last held
    patch, in the same transaction. A body left so by a process that died is merged again
    from its blob by any sweeper (:func:`recover_held`; merges are idempotent), and so
    is a body whose patches a flush could not merge. Past ``behind`` patches the request
    that adds more flushes what is due itself, and past ``limit`` everything
    (back-pressure)."""

    def __init__(self, age: float = 0.5, limit: int = 200_000, behind: int = 10_000) -> None:
        self.age = age
        self.limit = limit
        self.behind_at = behind
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one flush at a time: patches merge in key order
        # session id -> held patches in the order they came (so the aged ones lead)
        self._tasks: dict[int, dict[tuple[str, int], _Held]] = {}
        self._complete: dict[int, set[tuple[str, int]]] = {}  # complete in the hold
        self._left: dict[int, int] = {}  # body id -> its patches still held
        # bodies a failed flush dropped patches of: never marked by the hold (recovery
        # merges them from their blobs, body by body)
        self._poisoned: set[int] = set()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, session_id: int, body_id: int, patches: list[TaskPatch]) -> None:
        """Hold a committed body's task patches (one per task attempt)."""
        now = time.monotonic()
        with self._lock:
            held = self._tasks.setdefault(session_id, {})
            complete = self._complete.setdefault(session_id, set())
            for p in patches:
                k = (p.task_id, p.attempt)
                h = held.get(k)
                if h is None:
                    held[k] = h = _Held(p, now, (body_id,))
                    self._count += 1
                else:
                    _fold(h.patch, p)
                    h.bodies += (body_id,)
                if _complete(h.patch):
                    complete.add(k)
            self._left[body_id] = self._left.get(body_id, 0) + len(patches)

    @property
    def full(self) -> bool:
        """Over ``limit`` patches: the caller flushes everything before acknowledging more."""
        return self._count > self.limit

    @property
    def behind(self) -> bool:
        """Over ``behind`` patches (the flushes trail the requests by a second or more):
        the caller flushes what is due before acknowledging more."""
        return self._count > self.behind_at

    def _take(self, force: bool) -> tuple[dict[int, list[_Held]], dict[int, list[int]]]:
        """The patches due (all with ``force``) per session, and per session the bodies
        none of whose patches stay held (poisoned ones too: they stay poisoned until the
        flush is over, so that a put-back leaves them so)."""
        cutoff = time.monotonic() - self.age
        due: dict[int, list[_Held]] = {}
        released: dict[int, list[int]] = {}
        with self._lock:
            for sid, held in self._tasks.items():
                if force:
                    go = list(held)
                else:
                    complete = self._complete.get(sid, set())
                    go = list(complete)
                    for k, h in held.items():  # oldest first
                        if h.since > cutoff:
                            break
                        if k not in complete:
                            go.append(k)
                self._complete.pop(sid, None)
                if go:
                    due[sid] = [held.pop(k) for k in go]
                    released[sid] = []
                    self._count -= len(go)
                    for h in due[sid]:
                        for b in h.bodies:
                            n = self._left[b] - 1
                            if n:
                                self._left[b] = n
                            else:
                                del self._left[b]
                                released[sid].append(b)
            self._tasks = {sid: held for sid, held in self._tasks.items() if held}
        return due, released

    def _put_back(self, due: dict[int, list[_Held]]) -> None:
        """After a failed flush: the patches lead their sessions again (still the oldest),
        folded with any that came meanwhile."""
        with self._lock:
            for sid, hs in due.items():
                held: dict[tuple[str, int], _Held] = {}
                for h in hs:
                    held[(h.patch.task_id, h.patch.attempt)] = h
                    for b in h.bodies:
                        self._left[b] = self._left.get(b, 0) + 1
                self._count += len(held)
                for k, h in self._tasks.get(sid, {}).items():
                    old = held.get(k)
                    if old is None:
                        held[k] = h
                    else:
                        _fold(old.patch, h.patch)
                        old.bodies += h.bodies
                        self._count -= 1
                self._tasks[sid] = held
                complete = self._complete.setdefault(sid, set())
                complete.update(k for k, h in held.items() if _complete(h.patch))

    def flush(
        self,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        *,
        force: bool = False,
        cache: IdCache | None = None,
    ) -> int:
        """Merge the patches due (every one with ``force``), a transaction per session, which
        marks the bodies whose last held patch it merges and writes the tasks the merge
        completes (one derived batch). A session whose flush fails (or that failed a
        moment ago and is left alone for a while, doubling up to a minute) has its patches
        dropped from the hold and its bodies left to recovery (:func:`recover_held`,
        from their blobs, through the queue): nothing acknowledged is lost, the hold does
        not grow with a session that cannot be written, and the other sessions go on. A
        flush interrupted (a ``BaseException``) puts back what it had not merged. Returns
        how many patches were merged."""
        with self._flushing:
            due, released = self._take(force)
            waiting = set(_flush_pause.waiting(sessions, time.monotonic()))
            sids = sorted(due)
            merged = 0
            for i, sid in enumerate(sids):
                try:
                    if sid in waiting and not force:
                        self._drop(due[sid], released[sid])
                        continue

                    def one(sid: int = sid) -> SweepCounts:
                        return self._flush_session(
                            sessions, blobs, sid, due[sid], released[sid], cache
                        )

                    merged += _flush_pause.run(
                        sessions,
                        sid,
                        "merging held task patches (their bodies are left to recovery)",
                        one,
                    ).tasks
                except BaseException:
                    self._put_back({s: due[s] for s in sids[i:]})  # this one and the rest
                    raise
            return merged

    def _flush_session(
        self,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        sid: int,
        due: list[_Held],
        released: list[int],
        cache: IdCache | None,
    ) -> SweepCounts:
        patches = sorted((h.patch for h in due), key=lambda p: (p.task_id, p.attempt))
        with self._lock:
            done = [b for b in released if b not in self._poisoned]
        try:
            with sessions.begin() as db:
                # The session row first (KEY SHARE), as retention's delete locks it and
                # then, by cascade, the manifest rows.
                if _session_kept(db, sid):
                    _mark_merged(db, done)
                    _merge_and_write(db, blobs, sid, patches, cache)
        except Exception as exc:
            self._drop(due, released)
            if not isinstance(exc, DataError):
                raise  # logged, and the session's flushes paused (_flush_pause)
            # A value the index cannot hold. Folded patches mix bodies, so which body
            # brought it is unknown here: recovery merges them one by one from their
            # blobs, as each body's own request would have (a good body's fields of the
            # same task are kept).
            logger.error(
                "Ray: the index refused held task patches (%s); their bodies are "
                "merged again from their blobs, one by one",
                exc.orig,
            )
            return SweepCounts()
        with self._lock:
            self._poisoned.difference_update(released)
        return SweepCounts(tasks=len(patches))

    def _drop(self, due: list[_Held], released: list[int]) -> None:
        """Drop patches a flush could not merge: their bodies are not marked (those still
        partly held never will be by this hold), so recovery merges them from their blobs."""
        with self._lock:
            self._poisoned |= {b for h in due for b in h.bodies if b in self._left}
            self._poisoned.difference_update(released)


def _session_kept(db: Session, session_id: int) -> bool:
    """Whether the session still exists, its row held (KEY SHARE, as a foreign key would)
    until the transaction ends: retention, which deletes the session row before its
    ray_tasks (no foreign key there), then waits for this merge or is seen to have run."""
    S = m.Session
    q = select(S.id).where(S.id == session_id)
    if db.get_bind().dialect.name == "postgresql":
        q = q.with_for_update(read=True, key_share=True)  # FOR KEY SHARE (alone: NO KEY UPDATE)
    return db.execute(q).first() is not None


def _mark_merged(db: Session, bodies: list[int]) -> None:
    if bodies:
        B = m.RayBody.__table__
        db.execute(update(B).where(B.c.id.in_(sorted(bodies))).values(tasks_merged=True))


def _merge_and_write(
    db: Session,
    blobs: BlobStore,
    session_id: int,
    patches: list[TaskPatch],
    cache: IdCache | None,
    batch: int = 20_000,
) -> int:
    """Merge task patches (in key order) into ``ray_tasks`` (Postgres) and write the tasks
    they complete in the same transaction (a derived batch per ``batch`` tasks), where
    :func:`_merge_patches` alone queues them. Returns how many tasks were written."""
    now = time.time()
    rows = _merge_patches(db, session_id, patches, now, take=True)
    if rows:
        _write_tasks(db, blobs, session_id, rows, now, cache, batch)
    return len(rows)


def _merge_patches(
    db: Session,
    session_id: int,
    patches: list[TaskPatch],
    now: float | None = None,
    *,
    take: bool = False,
) -> list[Any]:
    """Merge task patches (in key order) into ``ray_tasks`` (Postgres), queueing in
    ``ray_ready`` what they complete, or with ``take`` returning its rows, taken, for the
    caller to write in this transaction."""
    st, now = _stmts(db), time.time() if now is None else now
    rows: list[Any] = []
    for chunk in _chunks(patches, 5_000):
        got = db.execute(
            st.task_taken if take else st.task_bulk,
            {"p_rows": _encode(chunk).decode(), "p_session": session_id, "p_now": now},
        )
        if take:
            rows += got.all()
    return rows


def _merge_each(sessions: sessionmaker[Session], session_id: int, patches: list[TaskPatch]) -> None:
    """Merge patches one a transaction; one the index cannot hold is logged and left out
    (its body is stored, as a body refused whole in its request is)."""
    for p in patches:
        try:
            with sessions.begin() as db:
                _merge_patches(db, session_id, [p])
        except DataError as exc:
            logger.error(
                "Ray task %s attempt %s: the index cannot hold it; stored, not indexed: %s",
                p.task_id,
                p.attempt,
                exc.orig,
            )


#: A body whose task patches are still not merged this long after it came was held by a
#: process that died (a live one merges within TaskHold.age, or retries while the index is
#: down); any sweeper merges it again from its blob.
RECOVER_AFTER = 10.0


def recover_held(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    *,
    now: float | None = None,
    after: float = RECOVER_AFTER,
    limit: int = 50,
) -> SweepCounts:
    """Merge the task patches of bodies a dead process held (``ray_bodies.tasks_merged``
    false ``after`` seconds after they came) from their stored blobs, one body a
    transaction, each taken with SKIP LOCKED. Returns how many bodies (``batches``)."""
    now = time.time() if now is None else now
    B = m.RayBody
    out = SweepCounts()
    q = select(B.id, B.session_id).where(B.tasks_merged.is_(False), B.received_at <= now - after)
    waiting = _quarantine.waiting(sessions, time.monotonic())
    if waiting:  # a session whose bodies fail must not hold up the others'
        q = q.where(B.session_id.not_in(waiting))
    with sessions() as db:
        rows = db.execute(q.order_by(B.received_at).limit(limit)).all()
    for body_id, sid in rows:
        if not _quarantine.ready(sessions, [sid], time.monotonic()):
            continue
        out.add(
            _quarantine.run(
                sessions,
                sid,
                f"merging held body {body_id} again",
                lambda b=body_id: _remerge(sessions, blobs, b),
            )
        )
    return out


def _remerge(sessions: sessionmaker[Session], blobs: BlobStore, body_id: int) -> SweepCounts:
    try:
        return _remerge_body(sessions, blobs, body_id, each=False)
    except DataError:  # a value the index cannot hold: the body's other tasks are merged
        return _remerge_body(sessions, blobs, body_id, each=True)


def _remerge_body(
    sessions: sessionmaker[Session], blobs: BlobStore, body_id: int, *, each: bool
) -> SweepCounts:
    B = m.RayBody
    with sessions.begin() as db:
        # The session's row before the body's, the order retention takes them in (its
        # delete of the session cascades to the bodies): body first could deadlock with it.
        sid = db.scalar(select(B.session_id).where(B.id == body_id))
        if sid is None or not _session_kept(db, sid):  # retention took it
            return SweepCounts()
        q = select(B.blob_key).where(B.id == body_id, B.tasks_merged.is_(False))
        key = db.scalar(_skip_locked(q, db))
        if key is None:  # merged meanwhile, or another sweeper has it
            return SweepCounts()
        name = db.scalar(select(m.Session.name).where(m.Session.id == sid))
        patches: list[TaskPatch] = []
        try:
            data = blobs.get(key)
        except FileNotFoundError:  # retention took it
            logger.error(
                "Ray body %s: its blob %s is gone; its tasks cannot be merged", body_id, key
            )
        else:
            part = parse(read_stored(data)).get(name or "")
            if part is not None:
                patches = [t for _, t in sorted(part.tasks.items())]
        if each:
            _merge_each(sessions, sid, patches)
        else:
            _merge_patches(db, sid, patches)
        _mark_merged(db, [body_id])
    logger.warning(
        "Ray body %s: merged %d task patches a collector had held and not merged (it stopped)",
        body_id,
        len(patches),
    )
    return SweepCounts(tasks=0, batches=1)


# ------------------------------------------------------------------ reindex


def parse_raw_key(key: str) -> dict[str, str] | None:
    match = _RAW_RE.match(key)
    return match.groupdict() if match else None


def reindex(
    blobs: BlobStore,
    sessions: sessionmaker[Session],
    *,
    settle: float,
    idle: float,
) -> dict[str, int]:
    """Rebuild the Ray side of the index from the stored bodies. Two passes, so the result
    does not depend on the order bodies are listed in: merge every body not yet merged,
    then emit what is complete, the workers, the jobs' starts, and sweep as the collector
    does. Each body is merged as of when it was stored, so ``settle`` (the collector's)
    keeps a job whose end arrived moments ago open for its late events, as the live
    sweeper would (with 0 a rebuild on a live index closed it and wrote its tasks still
    under way as lost, for good). Safe on a live index and to repeat."""
    counts = {"ray_bodies": 0, "ray_merged": 0, "ray_already": 0, "ray_skipped": 0}
    touched: dict[int, tuple[int, str, str, str]] = {}
    tenants: dict[str, int] = {}
    for key, stored_at in blobs.listed(f"{RAW_PREFIX}/"):  # merged as of when it arrived
        counts["ray_bodies"] += 1
        ident = parse_raw_key(key)
        if ident is None:
            counts["ray_skipped"] += 1
            continue
        data = blobs.get(key)
        raw = read_stored(data)
        if hashlib.sha256(raw).hexdigest() != ident["sha"]:
            logger.error("skipping Ray body %s: its content does not match its name", key)
            counts["ray_skipped"] += 1
            continue
        try:
            parts = prepare(raw)
        except ValueError as exc:
            logger.error("skipping unreadable Ray body %s: %s", key, exc)
            counts["ray_skipped"] += 1
            continue
        tenant, cluster = ident["tenant"], ident["cluster"]
        for stored in parts:
            if stored.session != ident["session"] or stored.session == NO_SESSION:
                continue
            try:
                with sessions.begin() as db:
                    if tenant not in tenants:
                        tenants[tenant] = ensure_tenant(db, tenant, time.time())
                    res = index_part(
                        db,
                        blobs,
                        tenant_id=tenants[tenant],
                        tenant=tenant,
                        cluster=cluster,
                        stored=stored,
                        emit=False,
                        now=min(stored_at, time.time()),
                    )
                    if res.session_id is not None:
                        touched[res.session_id] = (tenants[tenant], tenant, cluster, stored.session)
            except DataError as exc:  # a value the index cannot hold: this body, not the rebuild
                logger.error("skipping Ray body %s: the index cannot hold it: %s", key, exc.orig)
                counts["ray_skipped"] += 1
                continue
            counts["ray_already" if res.duplicate else "ray_merged"] += 1
    # Bodies a collector held and did not merge (it died; no sweeper came since), from
    # their blobs (a live collector's held bodies merge twice: merges are idempotent).
    counts["ray_recovered"] = 0
    while True:
        got = recover_held(sessions, blobs, now=time.time(), after=0, limit=1_000)
        counts["ray_recovered"] += got.batches
        if got.batches + got.failed < 1_000:
            break
    for sid, (tenant_id, tenant, cluster, session) in touched.items():
        emit_session(sessions, blobs, sid, tenant_id, tenant, cluster, session)
    emit_ready(sessions, blobs, limit=1_000_000)  # what recovery completed
    sweep = run_due(sessions, blobs, settle=settle, idle=idle, limit=1_000_000)
    counts["ray_jobs_closed"] = sweep.jobs_closed
    return counts


def emit_session(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    session_id: int,
    tenant_id: int,
    tenant: str,
    cluster: str,
    session: str,
) -> int:
    """Write everything of a session that is complete (reindex's second pass)."""
    st = None
    with sessions.begin() as db:
        st = _stmts(db)
        rows = take_ready(db, session_id)
        rows += db.execute(st.emit_all_complete, {"p_session": session_id}).all()
        derived = Derived(tasks=tasks_as_events(db, session_id, rows))
        J, W = m.RayJob, m.RayWorker
        jobs = db.execute(select(J).where(J.session_id == session_id)).scalars().all()
        derived.runs = [e for e in (job_started(j) for j in jobs) if e is not None]
        workers = db.execute(select(W).where(W.session_id == session_id)).scalars().all()
        derived.workers = workers_of(db, session_id, list(workers), [])
        write_derived(
            db,
            blobs,
            tenant_id=tenant_id,
            tenant=tenant,
            cluster=cluster,
            session=session,
            derived=derived,
            now=time.time(),
        )
    return len(rows)
