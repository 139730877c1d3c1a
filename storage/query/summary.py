"""A run's per-prefix summary from the index: counts, bytes and duration quantiles."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.analysis import sketch
from storage.core import models as m
from storage.runs import packed

QUANTILES = (0.5, 0.9, 0.99)


def merged_hists(
    db: Session, run_ids: list[int], prefix: str | None = None
) -> dict[tuple[str, str], dict[int, int]]:
    """The runs' histograms per (prefix, action), merged."""
    out: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)
    for (_, p, a), h in packed.hists(db, run_ids, prefix=prefix).items():
        packed.add_hist(out[(p, a)], h)
    return out


def prefix_summary(db: Session, run: m.Run) -> list[dict[str, Any]]:
    """Per prefix: count, errors, bytes, and per action count/total/mean/min/p50/p90/p99/max.

    Quantiles come from the run's mergeable histograms (within 4.5%), clamped to the
    exact min and max."""
    hists = merged_hists(db, [run.id])
    prefixes: dict[str, dict[str, Any]] = {}
    for p in db.execute(
        select(m.RunPrefix).where(m.RunPrefix.run_id == run.id).order_by(m.RunPrefix.prefix)
    ).scalars():
        prefixes[p.prefix] = {
            "prefix": p.prefix,
            "count": p.count,
            "errors": p.errors,
            "nbytes": p.nbytes,
            "actions": {},
        }
    for a in db.execute(
        select(m.RunPrefixAction)
        .where(m.RunPrefixAction.run_id == run.id)
        .order_by(m.RunPrefixAction.prefix, m.RunPrefixAction.action)
    ).scalars():
        entry = prefixes.setdefault(
            a.prefix, {"prefix": a.prefix, "count": 0, "errors": 0, "nbytes": 0, "actions": {}}
        )
        p50, p90, p99 = sketch.quantiles(
            hists.get((a.prefix, a.action), {}), QUANTILES, a.min, a.max
        )
        entry["actions"][a.action] = {
            "count": a.count,
            "total": a.total,
            "mean": a.total / a.count if a.count else None,
            "min": a.min,
            "p50": p50,
            "p90": p90,
            "p99": p99,
            "max": a.max,
        }
    return list(prefixes.values())
