"""Histories across runs and clusters, from the index rollups."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from sqlalchemy import BigInteger, func, select, true
from sqlalchemy.orm import Session

from storage.analysis import sketch
from storage.core import models as m
from storage.query.breakdown import time_breakdown
from storage.query.summary import QUANTILES
from storage.runs import packed

BUCKETS = {"hour": 1, "day": 24}


def tenant_clusters(db: Session, tenant_id: int, cluster: str | None) -> dict[int, str]:
    q = select(m.Cluster.id, m.Cluster.name).where(m.Cluster.tenant_id == tenant_id)
    if cluster is not None:
        q = q.where(m.Cluster.name == cluster)
    return dict(db.execute(q).all())


def _hour_range(since: float | None, until: float | None) -> tuple[int | None, int | None]:
    lo = math.floor(since / 3600) if since is not None else None
    hi = math.ceil(until / 3600) if until is not None else None
    return lo, hi


def prefix_history(
    db: Session,
    tenant_id: int,
    prefix: str,
    action: str,
    bucket: str,
    since: float | None,
    until: float | None,
    cluster: str | None = None,
) -> list[dict[str, Any]]:
    """A prefix's duration quantiles per time bucket across the tenant's clusters (or one).
    Days come from the ``prefix_days`` rollup (by each task's first start); hours merge
    the histograms of the runs started in each hour."""
    clusters = tenant_clusters(db, tenant_id, cluster)
    if not clusters:
        return []
    if bucket == "day":
        return _prefix_days(db, list(clusters), prefix, action, since, until)
    sec = BUCKETS[bucket] * 3600
    runs = select(m.Run.id, func.floor(m.Run.started_at / sec).label("slot")).where(
        m.Run.tenant_id == tenant_id, m.Run.cluster_id.in_(list(clusters))
    )
    if since is not None:
        runs = runs.where(m.Run.started_at >= since)
    if until is not None:
        runs = runs.where(m.Run.started_at < until)
    r = runs.subquery()
    H, A = m.RunPrefixHist, m.RunPrefixAction
    hists: dict[int, dict[int, int]] = defaultdict(dict)
    # Rows of running runs (and late batches): merged in the database, each JSON histogram
    # expanded into (bucket, count) rows summed per slot.
    pg = db.get_bind().dialect.name == "postgresql"
    kv = (func.json_each_text if pg else func.json_each)(H.buckets).table_valued("key", "value")
    count = func.sum(kv.c.value.cast(BigInteger) if pg else kv.c.value)
    for s, b, c in db.execute(
        select(r.c.slot, kv.c.key, count)
        .select_from(r.join(H, H.run_id == r.c.id))
        .join(kv, true())
        .where(H.prefix == prefix, H.action == action)
        .group_by(r.c.slot, kv.c.key)
    ):
        hists[int(s)][int(b)] = int(c)
    # A finished run's histogram is packed into its action row (``storage.runs.packed``).
    for s, data in db.execute(
        select(r.c.slot, A.hist)
        .join(A, A.run_id == r.c.id)
        .where(A.prefix == prefix, A.action == action, A.hist.is_not(None))
    ):
        packed.add_packed(hists[int(s)], data)
    totals: dict[int, tuple[int, float, float]] = {}
    for s, c, t, hi in db.execute(
        select(r.c.slot, func.sum(A.count), func.sum(A.total), func.max(A.max))
        .join(A, A.run_id == r.c.id)
        .where(A.prefix == prefix, A.action == action)
        .group_by(r.c.slot)
    ):
        totals[int(s)] = (int(c), float(t), float(hi))
    out = []
    for s in sorted(hists):
        n, total, hi = totals.get(s, (sum(hists[s].values()), 0.0, None))
        p50, p90, p99 = sketch.quantiles(hists[s], QUANTILES, hi=hi)
        out.append(
            {
                "time": s * float(sec),
                "count": n,
                "mean": total / n if n else None,
                "p50": p50,
                "p90": p90,
                "p99": p99,
                "max": hi,
            }
        )
    return out


def _prefix_days(
    db: Session,
    cluster_ids: list[int],
    prefix: str,
    action: str,
    since: float | None,
    until: float | None,
) -> list[dict[str, Any]]:
    """Day buckets from the ``prefix_days`` rollup: one row per cluster and day, merged."""
    D = m.PrefixDay
    q = select(D.day, D.count, D.total, D.max, D.buckets, D.hist).where(
        D.cluster_id.in_(cluster_ids), D.prefix == prefix, D.action == action
    )
    if since is not None:
        q = q.where(D.day >= math.floor(since / 86400))
    if until is not None:
        q = q.where(D.day < math.ceil(until / 86400))
    per: dict[int, list[Any]] = {}
    for day, count, total, hi, buckets, hist in db.execute(q):
        e = per.setdefault(int(day), [{}, 0, 0.0, hi])
        packed.add_hist(e[0], buckets)  # a row written before migration 0020
        packed.add_packed(e[0], hist)
        e[1] += count
        e[2] += total
        e[3] = max(e[3], hi)
    out = []
    for day in sorted(per):
        h, n, total, hi = per[day]
        p50, p90, p99 = sketch.quantiles(h, QUANTILES, hi=hi)
        out.append(
            {
                "time": day * 86400.0,
                "count": n,
                "mean": total / n if n else None,
                "p50": p50,
                "p90": p90,
                "p99": p99,
                "max": hi,
            }
        )
    return out


def cluster_history(
    db: Session,
    tenant_id: int,
    bucket: str,
    since: float | None,
    until: float | None,
    cluster: str | None = None,
) -> list[dict[str, Any]]:
    """Per cluster per time bucket: runs started, tasks, errors, compute/transfer/disk seconds."""
    clusters = tenant_clusters(db, tenant_id, cluster)
    if not clusters:
        return []
    per = BUCKETS[bucket]
    CH = m.ClusterHour
    lo, hi = _hour_range(since, until)
    q = select(
        CH.cluster_id,
        (CH.hour - CH.hour % per).label("slot"),
        func.sum(CH.tasks),
        func.sum(CH.errors),
        func.sum(CH.compute),
        func.sum(CH.transfer),
        func.sum(CH.disk),
        func.sum(CH.nbytes),
    ).where(CH.cluster_id.in_(list(clusters)))
    if lo is not None:
        q = q.where(CH.hour >= lo)
    if hi is not None:
        q = q.where(CH.hour < hi)
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for cid, s, tasks, errs, comp, tr, disk, nb in db.execute(q.group_by(CH.cluster_id, "slot")):
        rows[(cid, int(s))] = {
            "cluster": clusters[cid],
            "time": int(s) * 3600.0,
            "runs": 0,
            "tasks": int(tasks),
            "errors": int(errs),
            "compute_seconds": comp,
            "transfer_seconds": tr,
            "disk_seconds": disk,
            "nbytes": int(nb),
        }
    sec = per * 3600
    rq = select(m.Run.cluster_id, m.Run.started_at).where(
        m.Run.tenant_id == tenant_id, m.Run.cluster_id.in_(list(clusters))
    )
    if since is not None:
        rq = rq.where(m.Run.started_at >= lo * 3600)
    if until is not None:
        rq = rq.where(m.Run.started_at < hi * 3600)
    sub = rq.subquery()
    for cid, s, n in db.execute(
        select(
            sub.c.cluster_id, func.floor(sub.c.started_at / sec).label("s"), func.count()
        ).group_by(sub.c.cluster_id, "s")
    ):
        hour = int(s) * per
        entry = rows.setdefault(
            (cid, hour),
            {
                "cluster": clusters[cid],
                "time": hour * 3600.0,
                "runs": 0,
                "tasks": 0,
                "errors": 0,
                "compute_seconds": 0.0,
                "transfer_seconds": 0.0,
                "disk_seconds": 0.0,
                "nbytes": 0,
            },
        )
        entry["runs"] = int(n)
    return [rows[k] for k in sorted(rows, key=lambda k: (clusters[k[0]], k[1]))]


def cluster_time_breakdown(
    db: Session, tenant_id: int, cluster: str, since: float | None, until: float | None
) -> dict[str, Any] | None:
    """Where the time went on one cluster: the time breakdown of its runs in the window;
    None for a cluster the tenant never recorded."""
    ids = tenant_clusters(db, tenant_id, cluster)
    if not ids:
        return None
    q = select(m.Run.id).where(m.Run.tenant_id == tenant_id, m.Run.cluster_id.in_(ids))
    if since is not None:
        q = q.where(m.Run.started_at >= since)
    if until is not None:
        q = q.where(m.Run.started_at < until)
    return time_breakdown(db, list(db.execute(q).scalars()))
