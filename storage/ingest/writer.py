"""The writer: apply one stored batch to the index. Used by the collector after the blob
write, and by reindex.

Every update here commutes: counts add, times take min/max, a run's status only moves
forward, JSON columns are set only while NULL, rollups are appended per batch. So applying
the same set of batches in any order, once each (the manifest's unique key sees to
"once"), gives the same index. That is what lets a retried batch, a crash between blob
write and index update, and ``hindsight reindex`` all converge.

Shared rows are few and taken late: a run's own rows (the run, its prefixes, actions and
workers) are upserted, and everything that many batches of a cluster share (duration
histograms, day and hour rollups) is appended as rows of this batch and summed by readers
until ``storage.runs.rollups`` folds them, off the ingest path, once the run has finished.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from hindsight.schema import Batch
from storage.analysis.runfacts import ACTION_COLUMNS
from storage.analysis.sketch import pack_hist
from storage.core import manifest
from storage.core import models as m
from storage.core.batches import blob_key as canonical_key
from storage.core.batches import run_public_id
from storage.core.idcache import IdCache
from storage.core.statements import Pipeline, statements
from storage.ingest import perf_index
from storage.ingest.aggregate import BatchAggregate, RunAggregate, aggregate

logger = logging.getLogger(__name__)

#: A finished run's finished-run work (``storage.jobs.finish``) is due once no batch has touched
#: the run for this long: batches of other agents (workers) may still be on their way.
FINISH_SETTLE_S = 5.0

_STATUS_RANK = {"running": 0, "lost": 1, "finished": 2, "erred": 3}


@dataclass(frozen=True, slots=True)
class _Ids:
    tenant: int
    cluster: int
    session: int
    agent: int
    batch: int


def index_batch(
    db: Session,
    *,
    tenant_id: int,
    tenant: str,
    batch: Batch,
    blob_key: str,
    size: int,
    now: float,
    agg: BatchAggregate | None = None,
    cache: IdCache | None = None,
    settle: float = FINISH_SETTLE_S,
) -> bool:
    """Apply one stored batch to the index. Returns False (and changes nothing) if this
    batch identity was already indexed. The caller owns the transaction. A run this batch
    leaves finished or erred gets its finished-run work queued, due ``settle`` seconds on."""
    st = statements(db.get_bind().dialect.name)
    agg = agg or aggregate(batch)
    out = Pipeline(db, st)
    # The manifest keeps a key only where the names do not give it (a reindex of keys
    # written otherwise): ~100 bytes of each row's ~250 (decision 0034).
    stored_key = "" if blob_key == canonical_key(tenant, batch) else blob_key
    ids = _manifest(db, out, tenant_id, batch, agg, stored_key, size, now, cache)
    if ids is None:
        return False
    if cache is None or cache.due("clusters", ids.cluster, now):
        out.add("touch_cluster", {"p_id": ids.cluster, "p_stale": now - 10, "p_now": now})
    if cache is None or cache.due("sessions", ids.session, now):
        out.add("touch_session", {"p_id": ids.session, "p_stale": now - 10, "p_now": now})
    out.add(
        "agent_update",
        {
            "p_id": ids.agent,
            "p_events": len(batch.events),
            "p_seq": batch.seq,
            "p_final": batch.final,
            "p_has_dropped": bool(batch.dropped),
            "p_dropped": dict(batch.dropped) if batch.dropped else None,
        },
    )
    run_ids: dict[str, int] = {}
    ended: list[int] = []
    for run_key in sorted(agg.runs):
        run_id, status = _index_run(out, tenant, ids, batch, run_key, agg.runs[run_key], now)
        run_ids[run_key] = run_id
        if status != "running":
            ended.append(run_id)
    for ev in sorted(agg.workers, key=lambda w: (w.address, w.time)):
        joined = ev.event == "joined"
        out.add(
            "worker",
            {
                "session_id": ids.session,
                "address": ev.address,
                "name": ev.name,
                "nthreads": ev.nthreads,
                "memory_limit": ev.memory_limit,
                "joined_at": ev.time if joined else None,
                "left_at": None if joined else ev.time,
                "left_reason": None if joined else ev.reason,
            },
        )
    if agg.session is not None:
        info = {
            "time": agg.session.time,
            "address": agg.session.address,
            "versions": agg.session.versions,
            "config": agg.session.config,
        }
        out.add("session_info", {"p_id": ids.session, "p_info": info})
    if agg.perf:
        out.flush()
        perf_index.index_perf(db, run_ids, agg.perf)
    _append_rollups(out, ids, run_ids, agg)
    if ended:
        out.add(
            "finish_enqueue",
            [{"run_id": r, "due_at": now + settle, "attempts": 0} for r in sorted(ended)],
        )
    out.flush()
    return True


def _manifest(
    db: Session,
    out: Pipeline,
    tenant_id: int,
    batch: Batch,
    agg: BatchAggregate,
    blob_key: str,
    size: int,
    now: float,
    cache: IdCache | None,
) -> _Ids | None:
    """Insert the batch's manifest row: its ids, or None if this identity was indexed."""
    st = out.st
    row = {
        "seq": batch.seq,
        "blob_key": blob_key,
        "events": len(batch.events),
        "bytes": size,
        "received_at": now,
        "t_min": agg.t_min,
        "t_max": agg.t_max,
    }
    key = (tenant_id, batch.cluster, batch.session, batch.agent)
    cached = cache.get(key) if cache else None
    if cached is not None:
        # Through cached ids, guarded: the insert happens only if they still name this
        # tenant/cluster/session/agent. None means duplicate or stale: take the slow path.
        # Through the pipeline: rendered and sent as it sends the rest (an ORM execute cost
        # more than the statement's round trip).
        found = out.one(
            "batch_guarded",
            {
                **row,
                "agent_id": cached[2],
                "p_agent": batch.agent,
                "p_session_id": cached[1],
                "p_session": batch.session,
                "p_cluster_id": cached[0],
                "p_cluster": batch.cluster,
                "p_tenant_id": tenant_id,
            },
        )
        if found is not None:
            return _Ids(tenant_id, *cached, found[0])
    seen = {"first_seen": now, "last_seen": now}
    cluster_id = st.cluster.id(db, {"tenant_id": tenant_id, "name": batch.cluster}, seen)
    session_id = st.session.id(db, {"cluster_id": cluster_id, "name": batch.session}, seen)
    agent_id = st.agent.id(
        db,
        {"session_id": session_id, "name": batch.agent},
        {"batches": 0, "events": 0, "max_seq": -1, "dropped_seq": -1},
    )
    if cache:
        cache.put(key, (cluster_id, session_id, agent_id))
    A = m.Agent
    lo, hi = db.execute(
        select(A.collapsed_lo, A.collapsed_hi)
        .where(A.id == agent_id)
        .with_for_update(key_share=True)
    ).one()
    if hi is not None and lo <= batch.seq <= hi and manifest.contains(db, agent_id, batch.seq):
        return None
    batch_id = db.execute(st.batch, {**row, "agent_id": agent_id}).scalar()
    if batch_id is None:
        return None
    return _Ids(tenant_id, cluster_id, session_id, agent_id, batch_id)


def _index_run(
    out: Pipeline,
    tenant: str,
    ids: _Ids,
    batch: Batch,
    run_key: str,
    rs: RunAggregate,
    now: float,
) -> tuple[int, str]:
    """Upsert a run and its per-prefix rows; returns the run's id and status after it."""
    started = [e for e in rs.events if e.event == "started"]
    ended = [e for e in rs.events if e.event != "started"]
    first = min(started, key=lambda e: e.time) if started else None
    status = max((e.event for e in ended), key=_STATUS_RANK.__getitem__, default="running")
    # The earliest evidence of the run: its started event, else its first task, else now.
    started_at = first.time if first else (rs.task_start if rs.task_start is not None else now)
    merged = {
        "session_id": ids.session,
        "run_key": run_key,
        "name": first.name if first else None,
        "span": list(first.span) if first and first.span else None,
        "client": first.client if first else None,
        "status": status,
        "started_at": started_at,
        "finished_at": max((e.time for e in ended), default=None),
        "task_start": rs.task_start,
        "task_stop": rs.task_stop,
        "task_count": rs.tasks,
        "error_count": rs.errors,
        "graph_count": rs.graph,
        "nbytes": rs.nbytes,
        "last_seen": now,
    }
    # An existing run is updated, a new one inserted: an upsert alone would take a run id
    # from the sequence for every batch (see storage.core.statements._run_update).
    found = out.one("run_update", {f"p_{k}": v for k, v in merged.items()})
    if found is None:
        found = out.one(
            "run",
            {
                **merged,
                "public_id": run_public_id(tenant, batch.cluster, batch.session, run_key),
                "tenant_id": ids.tenant,
                "cluster_id": ids.cluster,
                "first_seen": now,
            },
        )
    run_id, status = found
    if rs.tasks or rs.graph:
        out.add("run_batch", {"run_id": run_id, "batch_id": ids.batch, "tasks": rs.tasks})
    out.add(
        "statuses",
        [{"run_id": run_id, "status": s, "count": c} for s, c in sorted(rs.statuses.items())],
    )
    if rs.prefixes:
        out.add(
            "prefixes",
            [
                {
                    "run_id": run_id,
                    "prefix": p,
                    "count": v.count,
                    "errors": v.errors,
                    "nbytes": v.nbytes,
                }
                for p, v in sorted(rs.prefixes.items())
            ],
        )
    if rs.actions:
        out.add(
            "actions",
            [
                {
                    "run_id": run_id,
                    "prefix": p,
                    "action": a,
                    "count": v.count,
                    "total": v.total,
                    "min": v.min,
                    "max": v.max,
                }
                for (p, a), v in sorted(rs.actions.items())
            ],
        )
    return run_id, status


def _append_rollups(out: Pipeline, ids: _Ids, run_ids: dict[str, int], agg: BatchAggregate) -> None:
    """The batch's rows of the query rollups: appended (histograms, days, hours) or, for
    a run's workers, upserted in a fixed order so concurrent batches lock alike."""
    b = ids.batch
    hists = [
        {
            "run_id": run_ids[rk],
            "prefix": p,
            "action": a,
            "batch_id": b,
            "buckets": h,  # JSON object keys are strings: {"-24": 3, ...}
        }
        for rk, rs in agg.runs.items()
        for (p, a), h in rs.hists.items()
    ]
    out.add("hist_append", hists)
    if agg.days:
        out.add(
            "day_append",
            [
                {
                    "cluster_id": ids.cluster,
                    "prefix": p,
                    "action": a,
                    "day": d,
                    "batch_id": b,
                    "count": v.count,
                    "total": v.total,
                    "max": v.max,
                    "buckets": {},
                    "hist": pack_hist(v.buckets),
                }
                for (p, a, d), v in agg.days.items()
            ],
        )
    if agg.hours:
        out.add(
            "hour_append",
            [
                {
                    "cluster_id": ids.cluster,
                    "hour": h,
                    "batch_id": b,
                    "tasks": v.tasks,
                    "errors": v.errors,
                    "compute": v.compute,
                    "transfer": v.transfer,
                    "disk": v.disk,
                    "nbytes": v.nbytes,
                }
                for h, v in agg.hours.items()
            ],
        )
    workers = [
        {
            "run_id": run_ids[rk],
            "worker": w,
            "tasks": v.tasks,
            "errors": v.errors,
            **dict(zip(ACTION_COLUMNS, v.seconds, strict=True)),
            "first_start": v.first_start,
            "last_stop": v.last_stop,
        }
        for rk in sorted(agg.runs)
        for w, v in sorted(agg.runs[rk].workers.items())
    ]
    out.add("run_workers", workers)
