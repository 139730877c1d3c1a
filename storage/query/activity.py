"""Read Dask's fine performance metrics: one run's, and rolled up across runs.

``run_activity`` holds, per run, the cumulative value of each (context, prefix, activity,
unit) as of the run's last heartbeat (see ``storage.ingest.perf_index``); once the run has
finished, they are packed into its one ``run_metrics`` row (``storage.runs.packed``), and
readers read both. A run's seconds by activity and a prefix's or a job's seconds by
activity over time are sums over them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.core import models as m
from storage.runs import packed

FIELDS = ("context", "prefix", "activity", "unit", "value")
#: Bucket widths of the cross-run rollup, in seconds.
BUCKETS = {"hour": 3600, "day": 86400}


def run_activity(db: Session, run_id: int) -> dict[str, Any]:
    """A run's metrics, the totals by activity and unit (over contexts and prefixes), and
    the time of its latest sample."""
    metrics = packed.activity(db, [run_id]).get(run_id, {})
    activity = []
    totals: dict[tuple[str, str], float] = {}
    latest = None
    for (context, prefix, act, unit), (t, value) in sorted(metrics.items()):
        activity.append(dict(zip(FIELDS, (context, prefix, act, unit, value), strict=True)))
        totals[(act, unit)] = totals.get((act, unit), 0.0) + value
        latest = t if latest is None or t > latest else latest
    coverage = _coverage(db, run_id, activity) if activity else {}
    return {
        "activity": activity,
        "totals": [
            {"activity": a, "unit": u, "value": v}
            for (a, u), v in sorted(totals.items(), key=lambda kv: (kv[0][1], -kv[1]))
        ],
        "as_of": latest,
        "coverage": coverage,
        "partial": None if not activity else any(c < FULL for c in coverage.values()),
    }


#: A prefix's fine metrics are whole when its threads' seconds (cpu and noncpu) are at least
#: this share of its task records' compute seconds.
FULL = 0.85
#: Prefixes with fewer compute seconds than this are not judged (rounding, tiny tasks).
JUDGED_S = 0.5


def _coverage(db: Session, run_id: int, activity: list[dict[str, Any]]) -> dict[str, float]:
    """Per prefix with at least :data:`JUDGED_S` compute seconds in its task records: the
    share of them Dask's fine metrics hold as thread seconds. Short of :data:`FULL`, the
    metrics miss tasks (a worker killed before its next heartbeat, the run's last wave
    lost with its cluster)."""
    A = m.RunPrefixAction
    compute = dict(
        db.execute(
            select(A.prefix, A.total).where(
                A.run_id == run_id, A.action == "compute", A.total >= JUDGED_S
            )
        ).all()
    )
    threads: dict[str, float] = {}
    for row in activity:
        if (
            row["context"] == "execute"
            and row["unit"] == "seconds"
            and row["activity"] in ("thread-cpu", "thread-noncpu")
        ):
            threads[row["prefix"]] = threads.get(row["prefix"], 0.0) + row["value"]
    return {p: round(threads.get(p, 0.0) / total, 3) for p, total in sorted(compute.items())}


def seconds_by_prefix(activity: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{activity: {prefix: seconds}} of a run's ``execute`` metrics (Dask's view)."""
    out: dict[str, dict[str, float]] = {}
    for row in activity:
        if row["unit"] != "seconds":
            continue
        per = out.setdefault(row["activity"], {})
        key = row["prefix"] if row["context"] == "execute" else f"{row['context']}"
        per[key] = per.get(key, 0.0) + row["value"]
    return out


def history(
    db: Session,
    tenant_id: int,
    *,
    bucket: str,
    prefix: str | None = None,
    name: str | None = None,
    cluster: str | None = None,
    since: float | None = None,
    until: float | None = None,
    unit: str = "seconds",
) -> list[dict[str, Any]]:
    """Per bucket of run start: the runs, and per activity the total and the mean per run
    of ``unit`` (of ``prefix``'s tasks, or of every prefix), over runs named ``name``."""
    A, R = m.RunActivity, m.Run
    width = BUCKETS[bucket]
    slot = func.floor(R.started_at / width)
    runs_q = select(R.id.label("run_id"), slot.label("slot")).where(R.tenant_id == tenant_id)
    if name is not None:
        runs_q = runs_q.where(R.name == name)
    if cluster is not None:
        runs_q = runs_q.join(m.Cluster, m.Cluster.id == R.cluster_id).where(
            m.Cluster.name == cluster
        )
    if since is not None:
        runs_q = runs_q.where(R.started_at >= since)
    if until is not None:
        runs_q = runs_q.where(R.started_at < until)
    runs = runs_q.subquery()
    # Running runs' rows summed in the database; finished runs' packed rows
    # (``storage.runs.packed``) decoded here, one row a run.
    q = (
        select(runs.c.slot, A.run_id, A.activity, func.sum(A.value))
        .join(A, A.run_id == runs.c.run_id)
        .where(A.unit == unit)
        .group_by(runs.c.slot, A.run_id, A.activity)
    )
    if prefix is not None:
        q = q.where(A.prefix == prefix)
    sums: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    for s, r, act, total in db.execute(q):
        sums[(int(s), r)][act] = float(total)
    M = m.RunMetrics
    packed_of = {
        r: (int(s), data)
        for s, r, data in db.execute(
            select(runs.c.slot, M.run_id, M.data).join(M, M.run_id == runs.c.run_id)
        )
    }
    # a run with rows besides its packed ones (a late batch since): merged per metric
    both = packed.activity(db, [r for _, r in sums if r in packed_of])
    for r, (s, data) in packed_of.items():
        metrics = both.get(r) or packed.unpack_activity(data)
        own: dict[str, float] = {}
        for (_, p, act, u), (_, value) in sorted(metrics.items()):
            if u == unit and (prefix is None or p == prefix):
                own[act] = own.get(act, 0.0) + value
        sums.pop((s, r), None)
        if own:
            sums[(s, r)] = own
    per_slot: dict[int, dict[str, Any]] = {}
    runs_of: dict[tuple[int, str], set[int]] = defaultdict(set)
    for (s, r), acts in sorted(sums.items()):
        point = per_slot.setdefault(s, {"time": s * width, "runs": 0, "activity": {}})
        for act, total in sorted(acts.items()):
            v = point["activity"].setdefault(act, {"total": 0.0})
            v["total"] += total
            runs_of[(s, act)].add(r)
            point["runs"] = max(point["runs"], len(runs_of[(s, act)]))
    for point in per_slot.values():
        point["activity"] = dict(sorted(point["activity"].items()))
        for v in point["activity"].values():
            v["mean"] = v["total"] / point["runs"]
    return [per_slot[s] for s in sorted(per_slot)]
