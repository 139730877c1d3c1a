"""The history lake's finisher, and how retention and reindex keep the lake in step.

Layout, manifest format and filters: ``hindsight/lake.py``; commits and merging:
``storage/lake/write.py``; the user's view: docs/lake.md.

:func:`finish` runs once a run has finished and settled, again after a late batch, and for
every finished run on ``reindex`` (``storage/jobs/finish.py``). It takes the run's Arrow tables
from its compacted copy (``FinishedRun.data()``: tasks, metrics), adds the run's identity, a
summary row and the values its tasks emitted, and commits them to the partition of the day
the run started. It is idempotent: the run's ``tag`` (a hash of its summary and the blob
keys of its batches, stable across a rebuilt index) says whether the lake already holds this
version of the run, and then nothing is built or written.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from hindsight import lake as layout
from hindsight.lake import Manifest
from hindsight.schema import CustomEvent
from storage.analysis.runfacts import fingerprint
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.lake.write import TARGET_ROWS, Partition, RunRows, commit, read_manifest, schemas
from storage.query.runs import run_summary
from storage.runs import runlogs
from storage.runs.context import FinishedRun

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- one run's rows


def run_day(run: m.Run) -> str:
    """The partition of a run: the UTC day it started (its earliest evidence)."""
    for t in (run.started_at, run.task_start, run.first_seen):
        if t is not None:
            return layout.day_of(t)
    raise ValueError(f"run {run.public_id} has no time")


def run_tag(db: Session, run: m.Run, summary: dict[str, Any]) -> str:
    """The version of a run's lake rows: its summary and the blob keys of its batches
    (stable across a rebuilt index, unlike batch ids)."""
    keys = db.scalars(
        select(m.Batch.blob_key)
        .join(m.RunBatch, m.RunBatch.batch_id == m.Batch.id)
        .where(m.RunBatch.run_id == run.id)
        .order_by(m.Batch.blob_key)
    )
    h = hashlib.sha256(f"lake-v{layout.LAKE_VERSION}\n".encode())
    h.update(msgspec.json.encode(summary))
    for key in keys:
        h.update(b"\n" + key.encode())
    return h.hexdigest()[:32]


def _with_identity(table: Any, run: str, session: str, schema: Any) -> Any:
    import pyarrow as pa

    n = len(table)
    cols = [
        pa.repeat(pa.scalar(run, pa.string()), n),
        pa.repeat(pa.scalar(session, pa.string()), n),
    ]
    return pa.Table.from_arrays(cols + table.columns, schema=schema)


def emitted(db: Session, blobs: BlobStore, run: m.Run) -> Iterator[CustomEvent]:
    """The values the run's tasks emitted (``hindsight.emit``): the run's streams table
    (``storage.runs.runlogs``, built from the batches around the run once, by whichever of the
    two finishers needs it first), so the batches are not read a second time."""
    decode = msgspec.json.decode
    for r in runlogs.load(db, blobs, run).streams.to_pylist():
        yield CustomEvent(
            stream=r["stream"],
            time=r["time"],
            value=decode(r["value"]),
            worker=r["worker"],
            run=run.run_key,
            key=r["key"],
        )


def build_tables(
    run: m.Run, cluster: str, session: str, data: Any, values: Iterable[CustomEvent]
) -> dict[str, Any]:
    """The lake tables of one run from its compacted copy (``data``: tasks, metrics) and the
    values its tasks emitted."""
    import pyarrow as pa
    import pyarrow.compute as pc

    sch = schemas()
    pid = run.public_id
    renamed = ["duration" if c == "compute" else c for c in data.tasks.column_names]
    tasks = _with_identity(data.tasks.rename_columns(renamed), pid, session, sch["tasks"])
    metrics = _with_identity(data.metrics, pid, session, sch["metrics"])
    summary = run_summary(run, cluster, session)
    prefixes = sorted(p for p in pc.unique(data.tasks["prefix"]).to_pylist() if p is not None)
    total = lambda col: float(pc.sum(data.tasks[col]).as_py() or 0.0)  # noqa: E731
    runs = pa.Table.from_pylist(
        [
            {
                "run": pid,
                "session": session,
                "name": summary["name"],
                "run_key": run.run_key,
                "status": run.status,
                "started_at": run.started_at,
                "finished_at": run.finished_at,
                "task_start": run.task_start,
                "task_stop": run.task_stop,
                "makespan": summary["makespan"],
                "task_count": run.task_count,
                "error_count": run.error_count,
                "graph_count": run.graph_count,
                "nbytes": run.nbytes,
                "compute_seconds": total("compute"),
                "transfer_seconds": total("transfer"),
                "disk_read_seconds": total("disk_read"),
                "disk_write_seconds": total("disk_write"),
                "workers": pc.count_distinct(data.tasks["worker"]).as_py(),
                "prefixes": prefixes,
                "fingerprint": fingerprint(run.name, run.run_key, prefixes),
                "span": [str(s) for s in run.span or []],
                "client": run.client,
            }
        ],
        schema=sch["runs"],
    )
    rows: dict[str, list[Any]] = {
        n: [] for n in ("stream", "time", "worker", "key", "value", "number")
    }
    enc = msgspec.json.Encoder()
    for ev in values:
        v = ev.value
        number = float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
        for col, x in (
            ("stream", ev.stream),
            ("time", ev.time),
            ("worker", ev.worker),
            ("key", ev.key),
            ("value", enc.encode(v).decode()),
            ("number", number),
        ):
            rows[col].append(x)
    n = len(rows["stream"])
    streams = pa.table({"run": [pid] * n, "session": [session] * n, **rows}, schema=sch["streams"])
    return {"tasks": tasks, "metrics": metrics, "runs": runs, "streams": streams}


# ---------------------------------------------------------------- the finisher


def finish(fr: FinishedRun) -> None:
    """The lake's finisher (``storage/jobs/finish.py``): put the run's current rows in the lake."""
    db, blobs, run = fr.db, fr.blobs, fr.run
    summary = run_summary(run, fr.cluster, fr.session)
    tag = run_tag(db, run, summary)
    day = run_day(run)
    part = Partition(fr.tenant, fr.cluster, day, run.tenant_id, run.cluster_id)
    prev = db.execute(
        select(m.LakePartition.day)
        .join(m.LakeRun, m.LakeRun.partition_id == m.LakePartition.id)
        .where(m.LakeRun.run_id == run.id)
    ).scalar()
    if prev is not None and prev != day:  # a late batch moved the run's start
        commit(
            db,
            blobs,
            Partition(fr.tenant, fr.cluster, prev, run.tenant_id, run.cluster_id),
            remove=[run.public_id],
        )
    rows = RunRows(
        run.public_id,
        fr.session,
        tag,
        lambda: build_tables(run, fr.cluster, fr.session, fr.data(), emitted(db, blobs, run)),
    )
    commit(db, blobs, part, add=[rows])
    seal_previous(db, blobs, part)
    vacuum(db, blobs, limit=2)


def seal_previous(db: Session, blobs: BlobStore, part: Partition, now: float | None = None) -> None:
    """Seal (merge into one file per table) the newest earlier day of the cluster left
    with several small files: its runs finished while the day was still running."""
    now = time.time() if now is None else now
    P, F = m.LakePartition, m.LakeFile
    pid = db.execute(
        select(P.id)
        .join(F, F.partition_id == P.id)
        .where(
            P.cluster_id == part.cluster_id,
            P.day < layout.day_of(now),
            P.day != part.day,
            F.rows < min(TARGET_ROWS.values()) // 2,
        )
        .group_by(P.id, P.day, F.tbl)
        .having(func.count() > 1)
        .order_by(P.day.desc())
        .limit(1)
    ).scalar()
    if pid is not None and _try_lock(db, pid):
        commit(db, blobs, _partition_of(db, pid), now=now, seal=True)


def _try_lock(db: Session, pid: int) -> bool:
    """Lock a partition's row unless another transaction holds it. Work a finisher does
    on the side (sealing, vacuuming) never waits for a lock: two finishers each holding
    their own run's partition and waiting for the other's would deadlock."""
    P = m.LakePartition
    got = db.scalar(select(P.id).where(P.id == pid).with_for_update(skip_locked=True))
    return got is not None


def _partition_of(db: Session, pid: int) -> Partition:
    tenant, cluster, day, tenant_id, cluster_id = db.execute(
        select(
            m.Tenant.name,
            m.Cluster.name,
            m.LakePartition.day,
            m.LakePartition.tenant_id,
            m.LakePartition.cluster_id,
        )
        .join(m.Cluster, m.Cluster.id == m.LakePartition.cluster_id)
        .join(m.Tenant, m.Tenant.id == m.LakePartition.tenant_id)
        .where(m.LakePartition.id == pid)
    ).one()
    return Partition(tenant, cluster, day, tenant_id, cluster_id)


def vacuum(
    db: Session,
    blobs: BlobStore,
    *,
    now: float | None = None,
    limit: int = 100,
    tenant_id: int | None = None,
) -> int:
    """Delete superseded files past their grace period in up to ``limit`` partitions (a
    commit of each, so the manifests stop naming them). Returns partitions vacuumed."""
    now = time.time() if now is None else now
    P = m.LakePartition
    q = select(P.id).where(P.vacuum_at <= now).order_by(P.vacuum_at).limit(limit)
    if tenant_id is not None:
        q = q.where(P.tenant_id == tenant_id)
    done = 0
    for pid in db.scalars(q).all():
        if _try_lock(db, pid):
            commit(db, blobs, _partition_of(db, pid), now=now)
            done += 1
    return done


# ---------------------------------------------------------------- retention and reindex


def forget_session(
    db: Session, blobs: BlobStore, tenant: str, session_id: int, now: float | None = None
) -> int:
    """Take every run of a session out of the lake, deleting the files that held them at
    once (retention: the rows must go, not wait for a grace period). Returns partitions
    changed. Call it before the session's index rows go."""
    sess = db.get(m.Session, session_id)
    if sess is None:
        return 0
    cluster = db.get(m.Cluster, sess.cluster_id)
    assert cluster is not None
    P = m.LakePartition
    pids = set(
        db.scalars(
            select(m.LakeRun.partition_id)
            .join(m.Run, m.Run.id == m.LakeRun.run_id)
            .where(m.Run.session_id == session_id)
        )
    )
    # Also the days the session was alive (a run the index no longer lists as in the lake):
    # a run starts while its session lives; a day of slack for clocks.
    lo = layout.day_of(sess.first_seen - 86_400)
    pids |= set(
        db.scalars(
            select(P.id).where(
                P.cluster_id == cluster.id, P.day >= lo, P.day <= layout.day_of(sess.last_seen)
            )
        )
    )
    changed = 0
    for pid in sorted(pids):
        part = _partition_of(db, pid)
        before = read_manifest(blobs, *part.names).seq
        after = commit(db, blobs, part, remove_session=sess.name, now=now, grace=0.0)
        changed += after.seq != before
    return changed


def reconcile(
    blobs: BlobStore, sessions: sessionmaker[Session], *, now: float | None = None
) -> dict[str, int]:
    """Bring the lake in step with the index after ``reindex``: runs the index no longer
    knows leave the lake, and the index's catalog is rebuilt from the manifests. Runs the
    index knows but the lake lacks are the finishers' work (reindex finishes every run)."""
    counts = {"partitions": 0, "runs_removed": 0}
    for key in sorted(layout.latest_manifests(blobs.list(layout.MANIFESTS + "/")).values()):
        tenant, cluster, day, _seq = layout.parse_manifest_key(key)  # type: ignore[misc]
        with sessions.begin() as db:
            ids = db.execute(
                select(m.Tenant.id, m.Cluster.id)
                .join(m.Cluster, m.Cluster.tenant_id == m.Tenant.id)
                .where(m.Tenant.name == tenant, m.Cluster.name == cluster)
            ).first()
            manifest = read_manifest(blobs, tenant, cluster, day)
            if ids is None:
                # The index has no such cluster: nothing of the partition is known.
                known: set[str] = set()
                tenant_id = cluster_id = None
            else:
                tenant_id, cluster_id = ids
                known = set(
                    db.scalars(
                        select(m.Run.public_id).where(
                            m.Run.tenant_id == tenant_id, m.Run.public_id.in_(list(manifest.runs))
                        )
                    )
                )
            unknown = set(manifest.runs) - known
            if ids is None:
                _drop_partition(blobs, manifest)
            else:
                assert tenant_id is not None and cluster_id is not None
                part = Partition(tenant, cluster, day, tenant_id, cluster_id)
                commit(db, blobs, part, remove=unknown, now=now)
            counts["partitions"] += 1
            counts["runs_removed"] += len(unknown)
    return counts


def _drop_partition(blobs: BlobStore, manifest: Manifest) -> None:
    """Delete a partition the index cannot name (its cluster is gone): files, then manifests."""
    for f in manifest.files:
        blobs.delete(f.key)
    for r in manifest.removed:
        blobs.delete(r.key)
    for key in blobs.list(
        layout.manifest_dir(manifest.tenant, manifest.cluster, manifest.day) + "/"
    ):
        blobs.delete(key)
