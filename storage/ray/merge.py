"""Merging one stored exporter body into Ray's tables, in its own transaction."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import (
    select,
)
from sqlalchemy.orm import Session

from hindsight.schema import (
    WorkerEvent,
)
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.core.idcache import IdCache
from storage.ray.bodies import AGENT, StoredPart, in_chunks, raw_key
from storage.ray.derived import Derived, Lookups, tasks_as_events, write_derived
from storage.ray.events import (
    NO_SESSION,
    TaskPatch,
)
from storage.ray.hold import merge_patches
from storage.ray.statements import ensure_session, statements_for
from storage.ray.sweep import emit_locked, enqueue, take_ready
from storage.ray.translate import job_started, worker_events

logger = logging.getLogger(__name__)


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
    st = statements_for(db)
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
            merge_patches(db, sid, patches, now)
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
            for chunk in in_chunks(sorted(part.tasks)):
                enqueue(
                    db, sid, db.execute(st.emit_complete, {"p_session": sid, "p_keys": chunk}).all()
                )
    known = [n for n, patch in sorted(part.nodes.items()) if patch.ip]
    if known:
        # Tasks that were complete but for their node's IP (rows held by a concurrent merge
        # are left to it or to the sweeper).
        enqueue(db, sid, emit_locked(db, sid, [m.RayTask.node_id.in_(known), *st.complete]))
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
    ips = Lookups.ips(db, session_id, (r.node_id for r in by_id.values()))
    out = []
    for r in by_id.values():
        out += worker_events(r, ips.get(r.node_id or ""))
    return out
