"""A finished run's histograms and fine metrics packed into few catalog rows.

While a run runs, ingest appends a ``run_prefix_hist`` row per batch, prefix and action,
and upserts a ``run_activity`` row per (context, prefix, activity, unit): one row each,
so that concurrent batches never read or rewrite a shared value (decision 0003). Once the
run has finished, those rows are read one run or one prefix at a time and their per-row
cost dominated the catalog (decision 0034): the finisher (``storage.runs.rollups``) packs

- each (prefix, action)'s histogram into ``run_prefix_actions.hist``
  (``storage.analysis.sketch.pack_hist``), the row the run page and prefix history
  already read for count, total, min and max;
- all the run's fine metrics into one ``run_metrics`` row (:func:`pack_activity`);
- the list of the batches that hold its records (``run_batches``: one row per batch) into
  one ``run_batch_lists`` row (:func:`pack_batch_list`), which the finished-run work reads
  to version and rebuild its copies (:func:`run_batches`);
- its per-worker seconds (``run_workers``: one row per worker) into one
  ``run_worker_lists`` row (:func:`pack_worker_list`; read by :func:`run_workers`).

Packing deletes the rows it packs (``DELETE ... RETURNING``) and merges them with what
was packed before, in one transaction serialised on the run's row, exactly like a fold:
a row is packed by the transaction that deleted it, so a late batch's rows (written
after) are packed by the next finish and never counted twice. Readers read both the
packed values and whatever rows there are (:func:`hists`, :func:`activity`), so packing
changes no answer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import zstandard
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from storage.analysis.sketch import add_hist, add_packed, pack_hist, unpack_hist
from storage.core import manifest
from storage.core import models as m
from storage.core.batches import key_of
from storage.core.statements import dialect_functions

ZSTD_LEVEL = 6
_encoder = msgspec.msgpack.Encoder()

#: A fine metric's key: (context, prefix, activity, unit).
MetricKey = tuple[str, str, str, str]
#: Per fine metric: (time, value) of its latest sample.
Metrics = dict[MetricKey, tuple[float, float]]


# ------------------------------------------------------------------ histograms
def hists(
    db: Session,
    run_ids: Iterable[int],
    *,
    prefix: str | None = None,
    action: str | None = None,
) -> dict[tuple[int, str, str], dict[int, int]]:
    """Per (run, prefix, action): the histogram, its packed part and its rows summed."""
    ids = sorted(set(run_ids))
    out: dict[tuple[int, str, str], dict[int, int]] = defaultdict(dict)
    if not ids:
        return out
    A, H = m.RunPrefixAction, m.RunPrefixHist
    for i in range(0, len(ids), 5000):
        chunk = ids[i : i + 5000]
        qa = select(A.run_id, A.prefix, A.action, A.hist).where(
            A.run_id.in_(chunk), A.hist.is_not(None)
        )
        qh = select(H.run_id, H.prefix, H.action, H.buckets).where(H.run_id.in_(chunk))
        if prefix is not None:
            qa, qh = qa.where(A.prefix == prefix), qh.where(H.prefix == prefix)
        if action is not None:
            qa, qh = qa.where(A.action == action), qh.where(H.action == action)
        for r, p, a, data in db.execute(qa):
            add_packed(out[(r, p, a)], data)
        for r, p, a, buckets in db.execute(qh):
            add_hist(out[(r, p, a)], buckets)
    return out


def pack_hists(db: Session, run_id: int) -> int:
    """Move the run's ``run_prefix_hist`` rows into ``run_prefix_actions.hist`` (the caller
    holds the run's row lock); returns how many rows went. A histogram whose action row is
    missing stays a row (``batch_id`` 0), so nothing is lost."""
    H = m.RunPrefixHist.__table__
    A = m.RunPrefixAction.__table__
    deleted = db.execute(
        delete(H).where(H.c.run_id == run_id).returning(H.c.prefix, H.c.action, H.c.buckets)
    ).all()
    if not deleted:
        return 0
    merged: dict[tuple[str, str], dict[int, int]] = {}
    for p, a, buckets in deleted:
        add_hist(merged.setdefault((p, a), {}), buckets)
    packed = {
        (p, a): data
        for p, a, data in db.execute(
            select(A.c.prefix, A.c.action, A.c.hist).where(A.c.run_id == run_id)
        )
    }
    orphans = []
    for key, h in sorted(merged.items()):
        if key not in packed:
            buckets = {str(b): c for b, c in sorted(h.items())}
            orphans.append(
                {
                    "run_id": run_id,
                    "prefix": key[0],
                    "action": key[1],
                    "batch_id": 0,
                    "buckets": buckets,
                }
            )
            continue
        add_hist(h, unpack_hist(packed[key]))
        db.execute(
            update(A)
            .where(A.c.run_id == run_id, A.c.prefix == key[0], A.c.action == key[1])
            .values(hist=pack_hist(h))
        )
    if orphans:
        db.execute(H.insert(), orphans)
    return len(deleted)


# ------------------------------------------------------------------ fine metrics
def _newer(a: tuple[float, float], b: tuple[float, float] | None) -> bool:
    """Whether sample (time, value) ``a`` wins over ``b``: the later, ties the larger
    (the rule ``storage.ingest.perf_index`` applies, so merging commutes)."""
    return b is None or a > b


def pack_activity(metrics: Metrics) -> bytes:
    """Fine metrics {(context, prefix, activity, unit): (time, value)} as zstd-compressed
    msgpack of their sorted rows (names repeat across rows, which zstd folds)."""
    rows = [[*k, t, v] for k, (t, v) in sorted(metrics.items())]
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(_encoder.encode(rows))


def unpack_activity(data: bytes | None) -> Metrics:
    if not data:
        return {}
    rows = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(data))
    return {(c, p, a, u): (float(t), float(v)) for c, p, a, u, t, v in rows}


def activity(
    db: Session, run_ids: Iterable[int]
) -> dict[int, dict[MetricKey, tuple[float, float]]]:
    """Per run: its fine metrics {(context, prefix, activity, unit): (time, value)}, packed
    and rows merged (the later sample wins)."""
    ids = sorted(set(run_ids))
    out: dict[int, Metrics] = defaultdict(dict)
    M, A = m.RunMetrics, m.RunActivity
    for i in range(0, len(ids), 5000):
        chunk = ids[i : i + 5000]
        for r, data in db.execute(select(M.run_id, M.data).where(M.run_id.in_(chunk))):
            out[r].update(unpack_activity(data))
        for r, c, p, a, u, v, t in db.execute(
            select(A.run_id, A.context, A.prefix, A.activity, A.unit, A.value, A.time).where(
                A.run_id.in_(chunk)
            )
        ):
            have = out[r]
            if _newer((t, v), have.get((c, p, a, u))):
                have[(c, p, a, u)] = (t, v)
    return out


def pack_metrics(db: Session, run_id: int) -> int:
    """Move the run's ``run_activity`` rows into its ``run_metrics`` row (the caller holds
    the run's row lock); returns how many rows went."""
    A = m.RunActivity.__table__
    M = m.RunMetrics.__table__
    deleted = db.execute(
        delete(A)
        .where(A.c.run_id == run_id)
        .returning(A.c.context, A.c.prefix, A.c.activity, A.c.unit, A.c.value, A.c.time)
    ).all()
    if not deleted:
        return 0
    have = unpack_activity(
        db.execute(select(M.c.data).where(M.c.run_id == run_id)).scalar_one_or_none()
    )
    for c, p, a, u, v, t in deleted:
        if _newer((t, v), have.get((c, p, a, u))):
            have[(c, p, a, u)] = (t, v)
    insert, _, _ = dialect_functions(db.get_bind().dialect.name)
    ins = insert(M)
    db.execute(
        ins.on_conflict_do_update(index_elements=["run_id"], set_={"data": ins.excluded.data}),
        [{"run_id": run_id, "data": pack_activity(have)}],
    )
    return len(deleted)


# ------------------------------------------------------------------ the run's batches
def pack_batch_list(batches: list[tuple[int, int]]) -> bytes:
    """(batch id, tasks) pairs as msgpack integers: the first id, its tasks, then per
    further batch the step from the previous id and its tasks."""
    out: list[int] = []
    prev = 0
    for batch_id, tasks in sorted(batches):
        out += (batch_id - prev, tasks)
        prev = batch_id
    return _encoder.encode(out)


def unpack_batch_list(data: bytes | None) -> list[tuple[int, int]]:
    if not data:
        return []
    seq = msgspec.msgpack.decode(data)
    out = []
    b = 0
    for i in range(0, len(seq), 2):
        b += seq[i]
        out.append((b, seq[i + 1]))
    return out


def run_batches(db: Session, run_id: int) -> list[tuple[int, int]]:
    """The run's batches, (batch id, tasks of the run in it) by id: its packed list and
    its ``run_batches`` rows (a late batch's, or all of a running run's)."""
    L, RB = m.RunBatchList, m.RunBatch
    found = dict(
        unpack_batch_list(db.execute(select(L.data).where(L.run_id == run_id)).scalar_one_or_none())
    )
    for batch_id, tasks in db.execute(select(RB.batch_id, RB.tasks).where(RB.run_id == run_id)):
        found[batch_id] = tasks
    return sorted(found.items())


def batch_keys(db: Session, session_id: int, batch_ids: list[int]) -> list[tuple[int, str]]:
    """(batch id, blob key) of the batches of ``batch_ids`` (of the session ``session_id``)
    that exist, by id: their manifest rows, or the entries of the chunks their ids reach
    where they were collapsed (``storage.core.manifest``)."""
    out: list[tuple[int, str]] = []
    ids = sorted(set(batch_ids))
    for i in range(0, len(ids), 5000):
        out += keyed(db, m.Batch.id.in_(ids[i : i + 5000]))
    missing = set(ids) - {i for i, _ in out}
    if missing:
        C = m.ManifestChunk
        out += [
            (e.id, e.key)
            for e in manifest.collapsed(
                db,
                m.Agent.session_id == session_id,
                C.id_hi >= min(missing),
                C.id_lo <= max(missing),
            )
            if e.id in missing
        ]
    return sorted(out)


def keyed(db: Session, *where: Any, order: Any = None) -> list[tuple[int, str]]:
    """(batch id, blob key) of the batches ``where`` selects (on ``Batch`` and ``Agent``):
    the stored key, or the one the batch's names give where none is stored."""
    B, A, S, C, T = m.Batch, m.Agent, m.Session, m.Cluster, m.Tenant
    q = (
        select(B.id, B.blob_key, T.name, C.name, S.name, A.name, B.seq)
        .join(A, A.id == B.agent_id)
        .join(S, S.id == A.session_id)
        .join(C, C.id == S.cluster_id)
        .join(T, T.id == C.tenant_id)
        .where(*where)
    )
    if order is not None:
        q = q.order_by(order)
    return [(int(i), k or key_of(t, c, s, a, int(seq))) for i, k, t, c, s, a, seq in db.execute(q)]


def batch_tag(db: Session, run_id: int) -> tuple[int, int]:
    """How many batches hold the run's records, and the highest of their ids (the
    version of what its finished-run work read)."""
    found = run_batches(db, run_id)
    return len(found), (found[-1][0] if found else 0)


def pack_batches(db: Session, run_id: int) -> int:
    """Move the run's ``run_batches`` rows into its ``run_batch_lists`` row (the caller
    holds the run's row lock); returns how many rows went."""
    RB = m.RunBatch.__table__
    L = m.RunBatchList.__table__
    deleted = db.execute(
        delete(RB).where(RB.c.run_id == run_id).returning(RB.c.batch_id, RB.c.tasks)
    ).all()
    if not deleted:
        return 0
    have = dict(
        unpack_batch_list(
            db.execute(select(L.c.data).where(L.c.run_id == run_id)).scalar_one_or_none()
        )
    )
    have.update((b, t) for b, t in deleted)
    insert, _, _ = dialect_functions(db.get_bind().dialect.name)
    ins = insert(L)
    db.execute(
        ins.on_conflict_do_update(index_elements=["run_id"], set_={"data": ins.excluded.data}),
        [{"run_id": run_id, "data": pack_batch_list(sorted(have.items()))}],
    )
    return len(deleted)


# ------------------------------------------------------------------ the run's workers
@dataclass(slots=True)
class WorkerSeconds:
    """A run's tasks and seconds on one worker (the columns of ``run_workers``)."""

    worker: str
    tasks: int = 0
    errors: int = 0
    compute: float = 0.0
    transfer: float = 0.0
    disk_read: float = 0.0
    disk_write: float = 0.0
    other: float = 0.0
    first_start: float | None = None
    last_stop: float | None = None

    def add(self, row: Any) -> None:
        """Add a row (or another WorkerSeconds) as ingest's upsert does."""
        for c in _WORKER_SUMS:
            setattr(self, c, getattr(self, c) + getattr(row, c))
        if row.first_start is not None:
            fs = self.first_start
            self.first_start = row.first_start if fs is None else min(fs, row.first_start)
        if row.last_stop is not None:
            ls = self.last_stop
            self.last_stop = row.last_stop if ls is None else max(ls, row.last_stop)


_WORKER_SUMS = ("tasks", "errors", "compute", "transfer", "disk_read", "disk_write", "other")
_WORKER_SECONDS = _WORKER_SUMS[2:]
_WORKER_COLUMNS = (*_WORKER_SUMS, "first_start", "last_stop")


def _small(v: float | None) -> float | int | None:
    return 0 if v == 0 else v  # msgpack: 1 byte, not 9 (a worker that never spilled)


def pack_worker_list(workers: Iterable[WorkerSeconds]) -> bytes:
    """Per-worker rows as zstd-compressed msgpack (addresses repeat their host part)."""
    rows = [
        [w.worker, *(_small(getattr(w, c)) for c in _WORKER_COLUMNS)]
        for w in sorted(workers, key=lambda w: w.worker)
    ]
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(_encoder.encode(rows))


def unpack_worker_list(data: bytes | None) -> list[WorkerSeconds]:
    if not data:
        return []
    out = []
    for worker, tasks, errors, *seconds, first, last in msgspec.msgpack.decode(
        zstandard.ZstdDecompressor().decompress(data)
    ):
        w = WorkerSeconds(worker, int(tasks), int(errors), first_start=first, last_stop=last)
        for c, v in zip(_WORKER_SECONDS, seconds, strict=True):
            setattr(w, c, float(v))
        out.append(w)
    return out


def run_workers(db: Session, run_ids: Iterable[int]) -> dict[int, list[WorkerSeconds]]:
    """Per run: its workers' tasks and seconds by worker address, packed and rows merged."""
    ids = sorted(set(run_ids))
    found: dict[int, dict[str, WorkerSeconds]] = defaultdict(dict)
    L, RW = m.RunWorkerList, m.RunWorker
    for i in range(0, len(ids), 5000):
        chunk = ids[i : i + 5000]
        for r, data in db.execute(select(L.run_id, L.data).where(L.run_id.in_(chunk))):
            for w in unpack_worker_list(data):
                found[r][w.worker] = w
        for row in db.execute(select(RW).where(RW.run_id.in_(chunk))).scalars():
            found[row.run_id].setdefault(row.worker, WorkerSeconds(row.worker)).add(row)
    return {r: sorted(ws.values(), key=lambda w: w.worker) for r, ws in sorted(found.items())}


def pack_workers(db: Session, run_id: int) -> int:
    """Move the run's ``run_workers`` rows into its ``run_worker_lists`` row (the caller
    holds the run's row lock); returns how many rows went."""
    RW = m.RunWorker.__table__
    L = m.RunWorkerList.__table__
    deleted = db.execute(
        delete(RW)
        .where(RW.c.run_id == run_id)
        .returning(RW.c.worker, *(RW.c[c] for c in _WORKER_COLUMNS))
    ).all()
    if not deleted:
        return 0
    have = {
        w.worker: w
        for w in unpack_worker_list(
            db.execute(select(L.c.data).where(L.c.run_id == run_id)).scalar_one_or_none()
        )
    }
    for row in deleted:
        have.setdefault(row.worker, WorkerSeconds(row.worker)).add(row)
    insert, _, _ = dialect_functions(db.get_bind().dialect.name)
    ins = insert(L)
    db.execute(
        ins.on_conflict_do_update(index_elements=["run_id"], set_={"data": ins.excluded.data}),
        [{"run_id": run_id, "data": pack_worker_list(have.values())}],
    )
    return len(deleted)


def pack_run(db: Session, run_id: int) -> int:
    """Pack the run's histogram, fine-metric, batch and worker rows (after taking its row
    lock, in the order ingest takes it); returns how many rows went."""
    db.execute(select(m.Run.id).where(m.Run.id == run_id).with_for_update(key_share=True))
    return (
        pack_hists(db, run_id)
        + pack_metrics(db, run_id)
        + pack_batches(db, run_id)
        + pack_workers(db, run_id)
    )
