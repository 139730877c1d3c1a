"""Folding the appended rollup rows: off the ingest path, exactly once.

Ingest appends a row per batch to ``run_prefix_hist``, ``prefix_days`` and
``cluster_hours`` (``batch_id`` > 0) so that concurrent batches never read, lock or rewrite
a shared row; a finished run's histograms are packed the same way (``storage.runs.packed``).
Readers sum whatever rows there are, so folding changes no answer: it only keeps the rows
few. A fold deletes the appended rows *with* ``RETURNING`` and adds what it deleted into
the row with ``batch_id`` 0, in one transaction: a row is folded by the transaction that
deleted it, so two folds can never count it twice, and a crash rolls the deletion back.
Folds of one run (one cluster) are serialised on the run's (cluster's) row with
``FOR NO KEY UPDATE``, which ingest's foreign-key checks do not wait for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Table, delete, select
from sqlalchemy.orm import Session

from storage.core import models as m
from storage.core.statements import dialect_functions
from storage.runs import packed
from storage.runs.context import FinishedRun


def _lock(db: Session, model: Any, row_id: int) -> None:
    db.execute(select(model.id).where(model.id == row_id).with_for_update(key_share=True))


def fold_run(db: Session, run_id: int) -> int:
    """Fold the run's appended histogram rows, and its fine metrics, into their packed
    catalog rows (``storage.runs.packed``); returns how many rows were folded."""
    return packed.pack_run(db, run_id)


def fold_cluster(db: Session, cluster_id: int) -> int:
    """Fold the cluster's appended day and hour rows; returns how many were folded."""
    _lock(db, m.Cluster, cluster_id)
    D = m.PrefixDay.__table__
    days = db.execute(
        delete(D).where(D.c.cluster_id == cluster_id, D.c.batch_id != 0).returning(*_DAY_VALUES(D))
    ).all()
    merged_days: dict[tuple[str, str, int], list[Any]] = {}
    for prefix, action, day, *values in days:
        _add_day(merged_days.setdefault((prefix, action, day), [0, 0.0, None, {}]), *values)
    if merged_days:
        keys = sorted(merged_days)
        for prefix, action, day, *values in db.execute(
            select(*_DAY_VALUES(D)).where(
                D.c.cluster_id == cluster_id,
                D.c.batch_id == 0,
                D.c.prefix.in_(sorted({k[0] for k in keys})),
                D.c.day.in_(sorted({k[2] for k in keys})),
            )
        ):
            if (prefix, action, day) in merged_days:
                _add_day(merged_days[(prefix, action, day)], *values)
        _put(
            db,
            D,
            ["cluster_id", "prefix", "action", "day", "batch_id"],
            [
                {
                    "cluster_id": cluster_id,
                    "prefix": p,
                    "action": a,
                    "day": d,
                    "batch_id": 0,
                    "count": v[0],
                    "total": v[1],
                    "max": v[2],
                    "buckets": {},
                    "hist": packed.pack_hist(v[3]),
                }
                for (p, a, d), v in ((k, merged_days[k]) for k in keys)
            ],
            ("count", "total", "max", "buckets", "hist"),
        )
    return len(days) + _fold_hours(db, cluster_id)


def _DAY_VALUES(D: Table) -> tuple[Any, ...]:  # noqa: N802 (columns, as a constant reads)
    return (D.c.prefix, D.c.action, D.c.day, D.c.count, D.c.total, D.c.max, D.c.buckets, D.c.hist)


def _add_day(
    into: list[Any], count: int, total: float, hi: float, buckets: Any, hist: bytes | None
) -> None:
    into[0] += count
    into[1] += total
    into[2] = hi if into[2] is None else max(into[2], hi)
    packed.add_hist(into[3], buckets)
    packed.add_packed(into[3], hist)


def _fold_hours(db: Session, cluster_id: int) -> int:
    CH = m.ClusterHour.__table__
    sums = ("tasks", "errors", "compute", "transfer", "disk", "nbytes")
    deleted = db.execute(
        delete(CH)
        .where(CH.c.cluster_id == cluster_id, CH.c.batch_id != 0)
        .returning(CH.c.hour, *(CH.c[c] for c in sums))
    ).all()
    merged: dict[int, list[Any]] = {}
    for hour, *values in deleted:
        into = merged.setdefault(hour, [0] * len(sums))
        for i, v in enumerate(values):
            into[i] += v
    if not merged:
        return 0
    insert, _, _ = dialect_functions(db.get_bind().dialect.name)
    ins = insert(CH)
    db.execute(
        ins.on_conflict_do_update(
            index_elements=["cluster_id", "hour", "batch_id"],
            set_={c: CH.c[c] + ins.excluded[c] for c in sums},
        ),
        [
            {"cluster_id": cluster_id, "hour": h, "batch_id": 0, **dict(zip(sums, v, strict=True))}
            for h, v in sorted(merged.items())
        ],
    )
    return len(deleted)


def _put(
    db: Session, table: Table, keys: list[str], rows: list[dict[str, Any]], columns: Iterable[str]
) -> None:
    """Insert the folded rows, or replace their values (the caller merged the old ones in)."""
    if not rows:
        return
    insert, _, _ = dialect_functions(db.get_bind().dialect.name)
    ins = insert(table)
    db.execute(
        ins.on_conflict_do_update(index_elements=keys, set_={c: ins.excluded[c] for c in columns}),
        rows,
    )


def clusters_to_fold(db: Session, limit: int = 100) -> list[int]:
    """Clusters with appended day or hour rows."""
    D, CH = m.PrefixDay, m.ClusterHour
    ids = set(
        db.execute(select(D.cluster_id).where(D.batch_id != 0).distinct().limit(limit)).scalars()
    )
    ids |= set(
        db.execute(select(CH.cluster_id).where(CH.batch_id != 0).distinct().limit(limit)).scalars()
    )
    return sorted(ids)[:limit]


def finish(fr: FinishedRun) -> None:
    """Finisher: fold the run's rows and its cluster's. The cluster's row is locked before
    the run's, in the order ingest takes them."""
    fold_cluster(fr.db, fr.run.cluster_id)
    fold_run(fr.db, fr.run.id)
