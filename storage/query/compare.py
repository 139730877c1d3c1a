"""Runs against runs: one against another, and a run against its previous runs."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.analysis import sketch
from storage.analysis.runfacts import DEFAULT_SPAN, fingerprint, makespan
from storage.core import models as m
from storage.query.summary import QUANTILES, merged_hists
from storage.runs import packed


def run_fingerprint(db: Session, run: m.Run) -> str:
    prefixes = db.execute(select(m.RunPrefix.prefix).where(m.RunPrefix.run_id == run.id)).scalars()
    return fingerprint(run.name, run.run_key, prefixes)


def _prefix_stats(db: Session, run_ids: list[int], action: str) -> dict[str, dict[str, Any]]:
    hists = merged_hists(db, run_ids)
    out: dict[str, dict[str, Any]] = {}
    A = m.RunPrefixAction
    for p, count, total, lo, hi in db.execute(
        select(A.prefix, func.sum(A.count), func.sum(A.total), func.min(A.min), func.max(A.max))
        .where(A.run_id.in_(run_ids), A.action == action)
        .group_by(A.prefix)
    ):
        # clamped to the exact min and max, as the run summary's (a one-task prefix's p90 is
        # its duration, not the histogram bucket's value)
        p50, p90, p99 = sketch.quantiles(hists.get((p, action), {}), QUANTILES, lo, hi)
        out[p] = {
            "count": int(count),
            "total": float(total),
            "mean": float(total) / int(count),
            "p50": p50,
            "p90": p90,
            "p99": p99,
        }
    counts = db.execute(
        select(m.RunPrefix.prefix, func.sum(m.RunPrefix.count))
        .where(m.RunPrefix.run_id.in_(run_ids))
        .group_by(m.RunPrefix.prefix)
    ).all()
    for p, c in counts:
        out.setdefault(
            p, {"count": 0, "total": 0.0, "mean": None, "p50": None, "p90": None, "p99": None}
        )
        out[p]["tasks"] = int(c)
    return out


def _delta(a: float | None, b: float | None) -> dict[str, Any]:
    if a is None or b is None:
        return {"a": a, "b": b, "delta": None, "ratio": None}
    return {"a": a, "b": b, "delta": b - a, "ratio": (b / a) if a else None}


def compare(db: Session, a: m.Run, b: m.Run, action: str = "compute") -> dict[str, Any]:
    """Run ``b`` against run ``a``: makespan, per-prefix task counts and duration deltas,
    prefixes new in ``b`` or missing from it."""
    sa, sb = _prefix_stats(db, [a.id], action), _prefix_stats(db, [b.id], action)
    prefixes = []
    for p in sorted(set(sa) & set(sb)):
        x, y = sa[p], sb[p]
        prefixes.append(
            {
                "prefix": p,
                "tasks": _delta(x.get("tasks"), y.get("tasks")),
                "mean": _delta(x["mean"], y["mean"]),
                "p90": _delta(x["p90"], y["p90"]),
                "total": _delta(x["total"], y["total"]),
            }
        )
    # Sorted by the seconds of makespan each prefix's change explains: its change in
    # thread-seconds over run b's average concurrency (thread-seconds per makespan second).
    span_b = makespan(b.task_start, b.task_stop)
    busy = sum(y["total"] for y in sb.values())
    concurrency = max(busy / span_b, 1.0) if span_b else 1.0
    for row in prefixes:
        d = row["total"]["delta"]
        row["seconds"] = None if d is None else d / concurrency
    prefixes.sort(key=lambda r: (-abs(r["seconds"] or 0.0), r["prefix"]))
    return {
        "a": a.public_id,
        "b": b.public_id,
        "action": action,
        "makespan": _delta(
            makespan(a.task_start, a.task_stop), makespan(b.task_start, b.task_stop)
        ),
        "tasks": _delta(a.task_count, b.task_count),
        "errors": _delta(a.error_count, b.error_count),
        "prefixes": prefixes,
        "new_prefixes": sorted(set(sb) - set(sa)),
        "missing_prefixes": sorted(set(sa) - set(sb)),
    }


def previous_runs(
    db: Session, run: m.Run, n: int, scan: int = 1000, *, same_cluster: bool = False
) -> list[m.Run]:
    """The ``n`` latest runs of the tenant with the same fingerprint, started before ``run``
    and ended by its scheduler (a run still running, or closed "lost" when its scheduler
    went silent, holds part of its tasks: as a baseline it made the next run look 80%
    faster); with ``same_cluster``, of ``run``'s cluster only."""
    fp = run_fingerprint(db, run)
    q = select(m.Run).where(
        m.Run.tenant_id == run.tenant_id,
        m.Run.id != run.id,
        m.Run.started_at <= run.started_at,
        m.Run.status.in_(("finished", "erred")),
    )
    if same_cluster:
        q = q.where(m.Run.cluster_id == run.cluster_id)
    if run.name and run.name != DEFAULT_SPAN:  # the default span names no job
        q = q.where(m.Run.name == run.name)  # ix_runs_tenant_name
    candidates = list(db.execute(q.order_by(m.Run.started_at.desc()).limit(scan)).scalars())
    if not candidates:
        return []
    prefixes: dict[int, list[str]] = defaultdict(list)
    for rid, p in db.execute(
        select(m.RunPrefix.run_id, m.RunPrefix.prefix).where(
            m.RunPrefix.run_id.in_([c.id for c in candidates])
        )
    ):
        prefixes[rid].append(p)
    return [c for c in candidates if fingerprint(c.name, c.run_key, prefixes[c.id]) == fp][:n]


def regressions(
    db: Session,
    run: m.Run,
    baseline: int,
    threshold_pct: float,
    action: str = "compute",
    *,
    same_cluster: bool = False,
) -> dict[str, Any]:
    """Prefixes whose p90 in ``run`` moved more than ``threshold_pct`` against the median
    of the p90s of the previous ``baseline`` runs with the same fingerprint (of ``run``'s
    cluster only, with ``same_cluster``). The median, not the p90 of their tasks pooled:
    one slow run among five would set the pooled p90, so the normal run after it
    would read 61% faster and a slowdown right after it would be hidden."""
    prev = previous_runs(db, run, baseline, same_cluster=same_cluster)
    mine = _prefix_stats(db, [run.id], action)
    base = _median_p90(db, [p.id for p in prev], action) if prev else {}
    flagged, checked = [], []
    for p in sorted(set(mine) & set(base)):
        a, b = base[p], mine[p]["p90"]
        if a is None or b is None or a == 0:
            continue
        change = (b - a) / a * 100.0
        entry = {"prefix": p, "baseline_p90": a, "p90": b, "change_pct": change}
        checked.append(entry)
        if abs(change) > threshold_pct:
            flagged.append(entry | {"direction": "slower" if change > 0 else "faster"})
    return {
        "run": run.public_id,
        "fingerprint": run_fingerprint(db, run),
        "action": action,
        "threshold_pct": threshold_pct,
        "baseline_runs": [p.public_id for p in prev],
        "regressions": sorted(flagged, key=lambda e: -abs(e["change_pct"])),
        "checked": checked,
    }


def _median_p90(db: Session, run_ids: list[int], action: str) -> dict[str, float]:
    """Per prefix, the median over ``run_ids`` of each run's p90 of ``action``."""
    A = m.RunPrefixAction
    bounds = {
        (r, p): (lo, hi)
        for r, p, lo, hi in db.execute(
            select(A.run_id, A.prefix, A.min, A.max).where(
                A.run_id.in_(run_ids), A.action == action
            )
        )
    }
    p90s: dict[str, list[float]] = defaultdict(list)
    for (r, p, _), h in sorted(packed.hists(db, run_ids, action=action).items()):
        if (r, p) not in bounds:
            continue
        q = sketch.quantiles(h, QUANTILES, *bounds[(r, p)])[1]
        if q is not None:
            p90s[p].append(q)
    return {p: statistics.median(v) for p, v in p90s.items()}
