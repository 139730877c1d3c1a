"""The history lake's finisher, and how retention and reindex keep the lake in step.

Layout and filters: ``hindsight/lake.py``; the Iceberg tables, commits, merges and expiry:
``storage/lake/write.py``; the user's view: docs/lake.md.

:func:`finish` runs once a run has finished and settled, again after a late batch, and for
every finished run on ``reindex`` (``storage/jobs/finish.py``). It takes the run's Arrow tables
from its compacted copy (``FinishedRun.data()``: tasks, metrics), adds the run's identity, a
summary row and the values its tasks emitted, and commits them to the partition of the day
the run started. It is idempotent: the run's ``tag`` (a hash of its summary and the blob
keys of its batches, stable across a rebuilt index; the ``tag`` column of the runs table,
copied into the index's ``lake_runs``) says whether the lake already holds this version of
the run, and then nothing is built or written.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from hindsight import lake as layout
from hindsight.schema import CustomEvent
from storage.analysis.runfacts import fingerprint
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.lake import write
from storage.lake.spill import SortedRows
from storage.lake.write import Location, Partition, RunRows
from storage.query.runs import run_summary
from storage.runs import packed, runlogs
from storage.runs.context import FinishedRun
from storage.runs.runfile import table_rows

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
    keys = sorted(
        k
        for _, k in packed.batch_keys(
            db, run.session_id, [b for b, _ in packed.run_batches(db, run.id)]
        )
    )
    h = hashlib.sha256(b"lake-v1\n")  # as the lake before Iceberg: migrated runs stay current
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


#: Runs with more tasks than this go to the lake sorted through temporary files
#: (:class:`storage.lake.spill.SortedRows`), not as one table sorted in memory.
SPILL_ROWS = 1 << 19


def _task_parts(
    data: Any, columns: list[str] | None, run: str, session: str, schema: Any
) -> Iterator[Any]:
    """The run's lake task rows a part at a time: all of them (``columns`` None), or just
    those columns (named as the lake names them)."""
    if columns is not None:
        stored = ["compute" if c == "duration" else c for c in columns]
        for t in data.parts("tasks", stored):
            yield t.rename_columns(columns)
        return
    names = [f.name for f in schema][2:]  # after run and session
    stored = ["compute" if c == "duration" else c for c in names]
    for t in data.parts("tasks", stored):
        yield _with_identity(t.rename_columns(names), run, session, schema)


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
    run: m.Run,
    cluster: str,
    session: str,
    data: Any,
    values: Iterable[CustomEvent],
    tag: str | None = None,
) -> dict[str, Any]:
    """The lake tables of one run from its compacted copy (``data``: tasks, metrics) and the
    values its tasks emitted."""
    import pyarrow as pa
    import pyarrow.compute as pc

    sch = {t: layout.schema(t) for t in layout.TABLES}
    pid = run.public_id
    metrics = _with_identity(data.metrics, pid, session, sch["metrics"])
    summary = run_summary(run, cluster, session)
    # the run's row from a few columns of its tasks, a part at a time
    seen: dict[str, set[Any]] = {"prefix": set(), "worker": set()}
    sums = dict.fromkeys(("compute", "transfer", "disk_read", "disk_write"), 0.0)
    for t in data.parts("tasks", [*seen, *sums]):
        for col, distinct in seen.items():
            distinct.update(pc.unique(t[col]).to_pylist())
        for col in sums:
            sums[col] += float(pc.sum(t[col]).as_py() or 0.0)
    prefixes = sorted(p for p in seen["prefix"] if p is not None)
    total = sums.__getitem__
    tasks: Any
    if table_rows(data, "tasks") > SPILL_ROWS:
        tasks = SortedRows(
            write.SORT_KEYS["tasks"],
            lambda cols: _task_parts(data, cols, pid, session, sch["tasks"]),
            write.ROW_GROUP,
        ).spill()
    else:
        renamed = ["duration" if c == "compute" else c for c in data.tasks.column_names]
        tasks = _with_identity(data.tasks.rename_columns(renamed), pid, session, sch["tasks"])
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
                "workers": len(seen["worker"] - {None}),
                "prefixes": prefixes,
                "fingerprint": fingerprint(run.name, run.run_key, prefixes),
                "span": [str(s) for s in run.span or []],
                "client": run.client,
                "tag": tag,
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
    loc = write.location_of(db, blobs)
    summary = run_summary(run, fr.cluster, fr.session)
    tag = run_tag(db, run, summary)
    day = run_day(run)
    prev = db.execute(
        select(m.LakeRun.tag, m.LakePartition.day)
        .join(m.LakePartition, m.LakePartition.id == m.LakeRun.partition_id)
        .where(m.LakeRun.run_id == run.id)
    ).first()
    if prev is not None and tuple(prev) == (tag, day):
        return
    part = Partition(fr.tenant, fr.cluster, day)
    if prev is None and lake_tag(loc, part, run.public_id) == tag:
        # In the lake at this version, unknown to the index (an index rebuilt from the
        # batches): the index learns it, the lake is left alone.
        pid = _partition_id(db, run.tenant_id, run.cluster_id, day)
        db.add(m.LakeRun(run_id=run.id, partition_id=pid, tag=tag))
        return
    rows = RunRows(
        run.public_id,
        fr.session,
        tag,
        lambda: build_tables(run, fr.cluster, fr.session, fr.data(), emitted(db, blobs, run), tag),
    )
    # The index is written after the lake (its catalog lives in the same database: with
    # SQLite, a write held open here would block the lake's commit). Replacing is also
    # right for a run the index does not know to be there (an index rebuilt without
    # ``reconcile``): never twice in the lake.
    days = {day} | ({prev[1]} if prev is not None else set())
    write.commit_runs(loc, part, [rows], replace=[run.public_id], days=days)
    sealed = _maintain(db, loc, part, run.cluster_id)
    pid = _partition_id(db, run.tenant_id, run.cluster_id, day)
    db.execute(delete(m.LakeRun).where(m.LakeRun.run_id == run.id))
    db.add(m.LakeRun(run_id=run.id, partition_id=pid, tag=tag))
    if sealed:
        db.execute(update(m.LakePartition).where(m.LakePartition.id.in_(sealed)).values(seq=1))


def lake_tag(loc: Location, part: Partition, run: str) -> str | None:
    """The version (``tag``) of a run the lake's runs table holds in ``part``, if any."""
    from pyiceberg.expressions import And, EqualTo

    cond = And(part.expression(), EqualTo("run", run))
    got = write.table(loc, "runs").scan(row_filter=cond, selected_fields=("tag",)).to_arrow()
    return got["tag"][0].as_py() if len(got) else None


def _partition_id(db: Session, tenant_id: int, cluster_id: int, day: str) -> int:
    """The index's row of a lake partition (made if missing), marked unsealed: a day the
    lake has merged into one file per table has ``seq`` 1 until the next commit to it."""
    P = m.LakePartition
    pid = db.scalar(select(P.id).where(P.cluster_id == cluster_id, P.day == day))
    if pid is None:
        row = P(tenant_id=tenant_id, cluster_id=cluster_id, day=day, seq=0)
        db.add(row)
        db.flush()
        return row.id
    db.execute(update(P).where(P.id == pid).values(seq=0))
    return pid


def _maintain(db: Session, loc: Location, part: Partition, cluster_id: int) -> list[int]:
    """After a commit: merge the partition's small files, seal the cluster's earlier days
    (their runs finished while the day ran), expire old snapshots. Returns the index rows
    of the partitions sealed. Best effort: the run is in the lake already, and the next
    finish does it. Only reads the index (its writes come after the lake's commits)."""
    P = m.LakePartition
    sealed: list[int] = []
    try:
        write.compact(loc, part)
        today = layout.day_of(time.time())
        for pid, day in db.execute(
            select(P.id, P.day)
            .where(P.cluster_id == cluster_id, P.day < today, P.day != part.day, P.seq == 0)
            .order_by(P.day.desc())
            .limit(3)
        ).all():
            write.compact(loc, Partition(part.tenant, part.cluster, day))
            sealed.append(pid)
        write.expire(loc, every=write.EXPIRE_EVERY_S)
    except Exception:  # noqa: BLE001 - maintenance must not fail the run's finish
        logger.exception("lake: maintenance after %s failed", part)
    return sealed


# ---------------------------------------------------------------- retention and reindex


def forget_session(
    db: Session, blobs: BlobStore, tenant: str, session_id: int, now: float | None = None
) -> int:
    """Take every run of a session out of the lake, and delete the files that held them at
    once (retention: the rows must go, not wait for old snapshots to expire). Returns the
    tables changed. Call it before the session's index rows go."""
    from pyiceberg.expressions import And, EqualTo

    sess = db.get(m.Session, session_id)
    if sess is None:
        return 0
    cluster = db.get(m.Cluster, sess.cluster_id)
    assert cluster is not None
    loc = write.location_of(db, blobs)
    cond = And(
        EqualTo("tenant", tenant), EqualTo("cluster", cluster.name), EqualTo("session", sess.name)
    )
    changed = 0
    for name in layout.TABLES:
        tbl = write.table(loc, name)
        before = tbl.metadata.current_snapshot_id
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "did not match any records"
            tbl.delete(cond)
        changed += tbl.refresh().metadata.current_snapshot_id != before
    if changed:
        write.expire(loc, now=now, retain=0.0)
    # The index's rows of partitions left without another session's run go too.
    P, LR = m.LakePartition, m.LakeRun
    others = (
        select(LR.partition_id)
        .join(m.Run, m.Run.id == LR.run_id)
        .where(m.Run.session_id != session_id)
    )
    db.execute(delete(P).where(P.cluster_id == cluster.id, P.id.not_in(others)))
    return changed


def reconcile(
    blobs: BlobStore, sessions: sessionmaker[Session], *, now: float | None = None
) -> dict[str, int]:
    """Bring the lake in step with the index after ``reindex``: runs the index no longer
    knows leave the lake, and the index's ``lake_runs`` come back from the runs table. Runs
    the index knows but the lake lacks are the finishers' work (reindex finishes every
    run)."""
    from pyiceberg.expressions import And, EqualTo, In

    counts = {"partitions": 0, "runs_removed": 0}
    with sessions() as db:
        loc = write.location_of(db, blobs)
    held = (
        write.table(loc, "runs")
        .scan(selected_fields=("tenant", "cluster", "day", "run", "tag"))
        .to_arrow()
    )
    by_cluster: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in held.to_pylist():
        by_cluster.setdefault((r["tenant"], r["cluster"]), []).append(r)
    for (tenant, cluster), rows in sorted(by_cluster.items()):
        with sessions.begin() as db:
            ids = db.execute(
                select(m.Tenant.id, m.Cluster.id)
                .join(m.Cluster, m.Cluster.tenant_id == m.Tenant.id)
                .where(m.Tenant.name == tenant, m.Cluster.name == cluster)
            ).first()
            known: dict[str, int] = {}
            if ids is not None:
                known = dict(
                    db.execute(
                        select(m.Run.public_id, m.Run.id).where(
                            m.Run.tenant_id == ids[0],
                            m.Run.public_id.in_([r["run"] for r in rows]),
                        )
                    ).all()
                )
            unknown = sorted({r["run"] for r in rows} - set(known))
            for r in rows:
                if r["run"] not in known or ids is None:
                    continue
                pid = _partition_id(db, ids[0], ids[1], r["day"])
                db.execute(delete(m.LakeRun).where(m.LakeRun.run_id == known[r["run"]]))
                db.add(m.LakeRun(run_id=known[r["run"]], partition_id=pid, tag=r["tag"] or ""))
            counts["partitions"] += len({r["day"] for r in rows})
        if unknown:
            cond = And(
                And(EqualTo("tenant", tenant), EqualTo("cluster", cluster)), In("run", unknown)
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                write.delete_rows(loc, cond)
            counts["runs_removed"] += len(unknown)
    return counts
