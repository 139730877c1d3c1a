"""Derive the index from a batch. Used by the collector after the blob write, and by reindex.

Every update here commutes: counts add, times take min/max, a run's status only moves
forward. So applying the same set of batches in any order, once each (the manifest's
unique key sees to "once"), gives the same index. That is what lets a retried batch, a
crash between blob write and index update, and ``hindsight reindex`` all converge.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import zstandard
from sqlalchemy import case, func, literal, select, update
from sqlalchemy.orm import Session

from hindsight.schema import (
    Batch,
    GraphEvent,
    RunEvent,
    SessionEvent,
    TaskEvent,
    WorkerEvent,
    decode_batch,
)
from storage import models as m
from storage.db import greatest, insert_for, least

logger = logging.getLogger(__name__)

DEFAULT_RUN = "default"
_RUN_NS = uuid.UUID("6f0e4a52-3c9e-4f5b-9a43-1d2f8b7c6e10")
_KEY_RE = re.compile(
    r"^v1/(?P<tenant>[^/]+)/(?P<cluster>[^/]+)/(?P<session>[^/]+)/(?P<agent>[^/]+)/(?P<seq>\d{12})\.json\.zst$"
)


def blob_key(tenant: str, batch: Batch) -> str:
    """Where a batch lives: listing a prefix finds a tenant's, cluster's or session's batches."""
    return f"v1/{tenant}/{batch.cluster}/{batch.session}/{batch.agent}/{batch.seq:012d}.json.zst"


def parse_blob_key(key: str) -> dict[str, Any] | None:
    """The identity encoded in a blob key, or None for a key that is not a batch."""
    match = _KEY_RE.match(key)
    if not match:
        return None
    parts: dict[str, Any] = match.groupdict()
    parts["seq"] = int(parts["seq"])
    return parts


def decode_stored(data: bytes) -> Batch:
    """A batch as the blob store holds it (zstd-compressed JSON, possibly several frames)."""
    reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
    return decode_batch(reader.read())


def run_public_id(tenant: str, cluster: str, session: str, run_key: str) -> str:
    """The stable public id of a run (the same after a rebuild of the index)."""
    return str(uuid.uuid5(_RUN_NS, f"{tenant}/{cluster}/{session}/{run_key}"))


@dataclass
class RunSummary:
    tasks: int = 0
    errors: int = 0
    graph: int = 0
    nbytes: int = 0
    task_start: float | None = None
    task_stop: float | None = None
    statuses: dict[str, int] = field(default_factory=dict)
    # prefix -> [count, errors, nbytes]
    prefixes: dict[str, list[int]] = field(default_factory=dict)
    # (prefix, action) -> [count, total, min, max]
    actions: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    events: list[RunEvent] = field(default_factory=list)


@dataclass
class BatchSummary:
    runs: dict[str, RunSummary] = field(default_factory=dict)
    workers: list[WorkerEvent] = field(default_factory=list)
    session: SessionEvent | None = None


def summarize(batch: Batch) -> BatchSummary:
    """One pass over the events: everything the index needs, before touching the database."""
    out = BatchSummary()
    runs = out.runs
    for ev in batch.events:
        if type(ev) is TaskEvent:
            rk = ev.run or DEFAULT_RUN
            rs = runs.get(rk)
            if rs is None:
                rs = runs[rk] = RunSummary()
            rs.tasks += 1
            status = ev.status
            rs.statuses[status] = rs.statuses.get(status, 0) + 1
            erred = status == "erred"
            if erred:
                rs.errors += 1
            nb = ev.nbytes or 0
            rs.nbytes += nb
            prefix = ev.prefix
            p = rs.prefixes.get(prefix)
            if p is None:
                p = rs.prefixes[prefix] = [0, 0, 0]
            p[0] += 1
            p[1] += erred
            p[2] += nb
            actions = rs.actions
            for ss in ev.startstops:
                start, stop = ss.start, ss.stop
                d = stop - start
                a = actions.get((prefix, ss.action))
                if a is None:
                    actions[(prefix, ss.action)] = [1, d, d, d]
                else:
                    a[0] += 1
                    a[1] += d
                    if d < a[2]:
                        a[2] = d
                    if d > a[3]:
                        a[3] = d
                if rs.task_start is None or start < rs.task_start:
                    rs.task_start = start
                if rs.task_stop is None or stop > rs.task_stop:
                    rs.task_stop = stop
        elif type(ev) is GraphEvent:
            rk = ev.run or DEFAULT_RUN
            rs = runs.get(rk)
            if rs is None:
                rs = runs[rk] = RunSummary()
            rs.graph += 1
        elif type(ev) is RunEvent:
            rs = runs.get(ev.id)
            if rs is None:
                rs = runs[ev.id] = RunSummary()
            rs.events.append(ev)
        elif type(ev) is WorkerEvent:
            out.workers.append(ev)
        elif type(ev) is SessionEvent:
            out.session = ev
    return out


def _get_or_create(db: Session, model: Any, keys: dict[str, Any], values: dict[str, Any]) -> int:
    stmt = (
        insert_for(db, model)
        .values(**keys, **values)
        .on_conflict_do_nothing(index_elements=list(keys))
        .returning(model.id)
    )
    row_id = db.execute(stmt).scalar()
    if row_id is None:
        row_id = db.execute(select(model.id).filter_by(**keys)).scalar_one()
    return row_id


def _touch(db: Session, model: Any, row_id: int, now: float) -> None:
    # Only take the row lock when last_seen is stale: concurrent batches of one cluster
    # then do not queue behind each other on the cluster and session rows.
    db.execute(
        update(model).where(model.id == row_id, model.last_seen < now - 10).values(last_seen=now)
    )


def ensure_tenant(db: Session, name: str, now: float) -> int:
    """The id of tenant ``name``, created if new."""
    return _get_or_create(db, m.Tenant, {"name": name}, {"created_at": now})


_STATUS_RANK = {"running": 0, "finished": 1, "erred": 2}


class IdCache:
    """Ids of the clusters, sessions and agents this process has indexed batches for.

    Saves the three look-ups a batch would otherwise cost. A cached id is only ever used
    through :func:`_insert_batch_guarded`, which checks in the same statement that the id
    still names this tenant/cluster/session/agent, so a pruned or rebuilt index can never
    be written through a stale id.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self._ids: dict[tuple[int, str, str, str], tuple[int, int, int]] = {}
        self._touched: dict[tuple[str, int], float] = {}
        self._max = max_entries

    def get(self, key: tuple[int, str, str, str]) -> tuple[int, int, int] | None:
        return self._ids.get(key)

    def put(self, key: tuple[int, str, str, str], ids: tuple[int, int, int]) -> None:
        if len(self._ids) >= self._max:
            self._ids.clear()
            self._touched.clear()
        self._ids[key] = ids

    def forget(self, key: tuple[int, str, str, str]) -> None:
        self._ids.pop(key, None)

    def due(self, table: str, row_id: int, now: float, every: float = 10.0) -> bool:
        """Whether this process should refresh ``last_seen`` on the row (at most every 10 s)."""
        if now - self._touched.get((table, row_id), 0.0) < every:
            return False
        self._touched[(table, row_id)] = now
        return True


def _batch_values(
    agent_id: int, batch: Batch, blob_key: str, size: int, now: float
) -> dict[str, Any]:
    return {
        "agent_id": agent_id,
        "seq": batch.seq,
        "blob_key": blob_key,
        "events": len(batch.events),
        "bytes": size,
        "received_at": now,
    }


def _insert_batch_guarded(
    db: Session, tenant_id: int, ids: tuple[int, int, int], batch: Batch, values: dict[str, Any]
) -> int | None:
    """Insert the manifest row through cached ids, only if they still name this batch's
    tenant, cluster, session and agent. None: duplicate or stale ids (take the slow path)."""
    cluster_id, session_id, agent_id = ids
    B = m.Batch.__table__
    cols = list(values)
    guard = (
        select(*(literal(values[c], B.c[c].type).label(c) for c in cols))
        .select_from(m.Agent.__table__.join(m.Session.__table__).join(m.Cluster.__table__))
        .where(
            m.Agent.id == agent_id,
            m.Agent.name == batch.agent,
            m.Session.id == session_id,
            m.Session.name == batch.session,
            m.Cluster.id == cluster_id,
            m.Cluster.name == batch.cluster,
            m.Cluster.tenant_id == tenant_id,
        )
    )
    stmt = (
        insert_for(db, m.Batch)
        .from_select(cols, guard)
        .on_conflict_do_nothing(index_elements=["agent_id", "seq"])
        .returning(m.Batch.id)
    )
    return db.execute(stmt).scalar()


def index_batch(
    db: Session,
    *,
    tenant_id: int,
    tenant: str,
    batch: Batch,
    blob_key: str,
    size: int,
    now: float,
    summary: BatchSummary | None = None,
    cache: IdCache | None = None,
) -> bool:
    """Apply one stored batch to the index. Returns False (and changes nothing) if this
    batch identity was already indexed. The caller owns the transaction."""
    key = (tenant_id, batch.cluster, batch.session, batch.agent)
    ids = cache.get(key) if cache else None
    batch_id = None
    if ids is not None:
        batch_id = _insert_batch_guarded(
            db, tenant_id, ids, batch, _batch_values(ids[2], batch, blob_key, size, now)
        )
    if batch_id is None:
        # First batch of this agent in this process, a duplicate, or stale cached ids.
        cluster_id = _get_or_create(
            db,
            m.Cluster,
            {"tenant_id": tenant_id, "name": batch.cluster},
            {"first_seen": now, "last_seen": now},
        )
        session_id = _get_or_create(
            db,
            m.Session,
            {"cluster_id": cluster_id, "name": batch.session},
            {"first_seen": now, "last_seen": now},
        )
        agent_id = _get_or_create(db, m.Agent, {"session_id": session_id, "name": batch.agent}, {})
        ids = (cluster_id, session_id, agent_id)
        if cache:
            cache.put(key, ids)
        batch_id = db.execute(
            insert_for(db, m.Batch)
            .values(**_batch_values(agent_id, batch, blob_key, size, now))
            .on_conflict_do_nothing(index_elements=["agent_id", "seq"])
            .returning(m.Batch.id)
        ).scalar()
        if batch_id is None:
            return False
    cluster_id, session_id, agent_id = ids

    for table, model, row_id in (
        ("clusters", m.Cluster, cluster_id),
        ("sessions", m.Session, session_id),
    ):
        if cache is None or cache.due(table, row_id, now):
            _touch(db, model, row_id, now)
    A = m.Agent
    agent_values: dict[str, Any] = {
        "batches": A.batches + 1,
        "events": A.events + len(batch.events),
        "max_seq": greatest(db, A.max_seq, batch.seq),
    }
    if batch.final:
        agent_values["final_seq"] = batch.seq
    if batch.dropped:
        # Drop counters are cumulative: the highest sequence number's copy is the total.
        newer = A.dropped_seq < batch.seq
        agent_values["dropped"] = case(
            (newer, literal(dict(batch.dropped), A.dropped.type)), else_=A.dropped
        )
        agent_values["dropped_seq"] = case((newer, batch.seq), else_=A.dropped_seq)
    db.execute(update(A).where(A.id == agent_id).values(**agent_values))

    summary = summary or summarize(batch)
    for run_key in sorted(summary.runs):
        _index_run(
            db,
            tenant,
            tenant_id,
            cluster_id,
            session_id,
            batch,
            batch_id,
            run_key,
            summary.runs[run_key],
            now,
        )
    for ev in sorted(summary.workers, key=lambda w: (w.address, w.time)):
        _index_worker(db, session_id, ev)
    if summary.session is not None:
        info = {
            "time": summary.session.time,
            "address": summary.session.address,
            "versions": summary.session.versions,
            "config": summary.session.config,
        }
        db.execute(
            update(m.Session)
            .where(m.Session.id == session_id, m.Session.info.is_(None))
            .values(info=info)
        )
    return True


def _index_run(
    db: Session,
    tenant: str,
    tenant_id: int,
    cluster_id: int,
    session_id: int,
    batch: Batch,
    batch_id: int,
    run_key: str,
    rs: RunSummary,
    now: float,
) -> None:
    R = m.Run
    started = [e for e in rs.events if e.event == "started"]
    ended = [e for e in rs.events if e.event != "started"]
    first = min(started, key=lambda e: e.time) if started else None
    status = max((e.event for e in ended), key=_STATUS_RANK.__getitem__, default="running")
    values = {
        "public_id": run_public_id(tenant, batch.cluster, batch.session, run_key),
        "tenant_id": tenant_id,
        "cluster_id": cluster_id,
        "session_id": session_id,
        "run_key": run_key,
        "name": first.name if first else None,
        "span": list(first.span) if first and first.span else None,
        "client": first.client if first else None,
        "status": status,
        # The earliest evidence of the run: its started event, else its first task, else now.
        "started_at": first.time
        if first
        else (rs.task_start if rs.task_start is not None else now),
        "finished_at": max((e.time for e in ended), default=None),
        "task_start": rs.task_start,
        "task_stop": rs.task_stop,
        "task_count": rs.tasks,
        "error_count": rs.errors,
        "graph_count": rs.graph,
        "nbytes": rs.nbytes,
        "first_seen": now,
        "last_seen": now,
    }
    ins = insert_for(db, R).values(**values)
    ex = ins.excluded
    rank = lambda col: case({"running": 0, "finished": 1}, value=col, else_=2)  # noqa: E731
    run_id = db.execute(
        ins.on_conflict_do_update(
            index_elements=["session_id", "run_key"],
            set_={
                "name": _coalesce(R.name, ex.name),
                "span": case((R.span.is_(None), ex.span), else_=R.span),
                "client": _coalesce(R.client, ex.client),
                "status": case((rank(ex.status) > rank(R.status), ex.status), else_=R.status),
                "started_at": least(db, R.started_at, ex.started_at),
                "finished_at": greatest(db, R.finished_at, ex.finished_at),
                "task_start": least(db, R.task_start, ex.task_start),
                "task_stop": greatest(db, R.task_stop, ex.task_stop),
                "task_count": R.task_count + ex.task_count,
                "error_count": R.error_count + ex.error_count,
                "graph_count": R.graph_count + ex.graph_count,
                "nbytes": R.nbytes + ex.nbytes,
                "last_seen": greatest(db, R.last_seen, ex.last_seen),
            },
        ).returning(R.id)
    ).scalar_one()

    if rs.tasks or rs.graph:
        db.execute(
            insert_for(db, m.RunBatch).values(run_id=run_id, batch_id=batch_id, tasks=rs.tasks)
        )
    if rs.statuses:
        S = m.RunStatusCount
        ins = insert_for(db, S)
        db.execute(
            ins.on_conflict_do_update(
                index_elements=["run_id", "status"], set_={"count": S.count + ins.excluded.count}
            ),
            [{"run_id": run_id, "status": s, "count": c} for s, c in sorted(rs.statuses.items())],
        )
    if rs.prefixes:
        P = m.RunPrefix
        ins = insert_for(db, P)
        ex = ins.excluded
        db.execute(
            ins.on_conflict_do_update(
                index_elements=["run_id", "prefix"],
                set_={
                    "count": P.count + ex.count,
                    "errors": P.errors + ex.errors,
                    "nbytes": P.nbytes + ex.nbytes,
                },
            ),
            [
                {"run_id": run_id, "prefix": p, "count": c, "errors": e, "nbytes": nb}
                for p, (c, e, nb) in sorted(rs.prefixes.items())
            ],
        )
    if rs.actions:
        PA = m.RunPrefixAction
        ins = insert_for(db, PA)
        ex = ins.excluded
        db.execute(
            ins.on_conflict_do_update(
                index_elements=["run_id", "prefix", "action"],
                set_={
                    "count": PA.count + ex.count,
                    "total": PA.total + ex.total,
                    "min": least(db, PA.min, ex.min),
                    "max": greatest(db, PA.max, ex.max),
                },
            ),
            [
                {
                    "run_id": run_id,
                    "prefix": p,
                    "action": a,
                    "count": c,
                    "total": t,
                    "min": lo,
                    "max": hi,
                }
                for (p, a), (c, t, lo, hi) in sorted(rs.actions.items())
            ],
        )


def _coalesce(a: Any, b: Any) -> Any:
    return func.coalesce(a, b)


def _index_worker(db: Session, session_id: int, ev: WorkerEvent) -> None:
    W = m.Worker
    joined = ev.event == "joined"
    ins = insert_for(db, W).values(
        session_id=session_id,
        address=ev.address,
        name=ev.name,
        nthreads=ev.nthreads,
        memory_limit=ev.memory_limit,
        joined_at=ev.time if joined else None,
        left_at=None if joined else ev.time,
        left_reason=None if joined else ev.reason,
    )
    ex = ins.excluded
    db.execute(
        ins.on_conflict_do_update(
            index_elements=["session_id", "address"],
            set_={
                "name": _coalesce(W.name, ex.name),
                "nthreads": _coalesce(W.nthreads, ex.nthreads),
                "memory_limit": _coalesce(W.memory_limit, ex.memory_limit),
                "joined_at": least(db, W.joined_at, ex.joined_at),
                "left_at": greatest(db, W.left_at, ex.left_at),
                "left_reason": _coalesce(ex.left_reason, W.left_reason),
            },
        )
    )
