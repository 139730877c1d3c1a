"""Statistical profiles: call trees, their storage, and the formats profilers read.

Workers send one ``profile`` event per task prefix per profile cycle (1 s). Once a run
has finished, :func:`finish` attributes its workers' events to it and stores, in
``run_profiles``, one zstd-compressed tree per (prefix, worker), per prefix over all
workers, and over the whole run. So a run's profile, a prefix's profile over 100 runs
or the difference of two runs read a few small rows and never a raw batch.

Attribution. Dask keys profiles by prefix, not by run, so an event (worker, prefix,
cycle) belongs to a run when that run has a task of that prefix whose compute time on
that worker overlaps the cycle's ``[first, last]`` window of the run on that worker.
Two runs of one session computing the same prefix on the same worker in the same
second both get that cycle (Dask cannot tell their samples apart either).

Bounds. A stored tree keeps at most ``MAX_NODES`` nodes (``MAX_WORKER_NODES`` for
per-worker trees): the least-sampled frames are folded into their callers, whose own
samples grow by as much, so totals stay exact.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, or_, select
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from hindsight.schema import ProfileEvent
from storage.analysis.profile import (
    DYNAMIC_FILE,
    FrameKey,
    Profile,
    add_event,
    decode_into,
    encode,
    merge_into,
    merge_stored,
    name_dynamic_frames,
    prune,
)
from storage.analysis.rundata import RunData
from storage.core import models as m
from storage.core.batches import decode_stored
from storage.core.blobs import BlobStore
from storage.runs import detail, packed, runfile
from storage.runs.context import FinishedRun
from storage.runs.runcode import run_code

logger = logging.getLogger(__name__)

MAX_NODES = 5000
MAX_WORKER_NODES = 1000
#: Worker batches received this long before a run's first or after its last batch are
#: read for its profile (agents ship a cycle within a few seconds; a spool later).
WINDOW_SLACK_S = 60.0
#: Runs merged at most by a cross-run profile.
MAX_RUNS = 1000
#: Version of the stored tree format: part of every row's tag, so rows of an older format
#: are rebuilt rather than misread.
FORMAT = "p3"  # HSP3 trees


def _digest(key: FrameKey) -> str:
    return hashlib.sha1(
        f"{key[0]}\x00{key[1]}\x00{key[2]}".encode(), usedforsecurity=False
    ).hexdigest()


def frame_ids(
    db: Session, tenant_id: int, frames: dict[FrameKey, tuple[int, str]]
) -> dict[FrameKey, int]:
    """The tenant's ids of ``frames`` (identity -> display line), adding the new ones."""
    F = m.ProfileFrame.__table__
    digests = {_digest(k): k for k in frames}
    insert = _insert(db)
    out: dict[FrameKey, int] = {}
    ordered = sorted(digests)  # one order for every writer: no lock cycles
    for i in range(0, len(ordered), 1000):
        chunk = ordered[i : i + 1000]
        db.execute(
            insert(F).on_conflict_do_nothing(index_elements=["tenant_id", "digest"]),
            [
                {
                    "tenant_id": tenant_id,
                    "digest": d,
                    "name": digests[d][0],
                    "filename": digests[d][1],
                    "first_line": digests[d][2],
                    "line_number": frames[digests[d]][0],
                    "line": frames[digests[d]][1],
                }
                for d in chunk
            ],
        )
        for fid, d in db.execute(
            select(F.c.id, F.c.digest).where(F.c.tenant_id == tenant_id, F.c.digest.in_(chunk))
        ):
            out[digests[d]] = fid
    return out


def resolve(db: Session, tenant_id: int, p: Profile) -> Profile:
    """Name the frames of a tree read from the index (in the tenant's frame ids)."""
    ids = sorted(p.frame_ids())
    F = m.ProfileFrame
    for i in range(0, len(ids), 5000):
        for fid, name, filename, first, line_number, line in db.execute(
            select(F.id, F.name, F.filename, F.first_line, F.line_number, F.line).where(
                F.tenant_id == tenant_id, F.id.in_(ids[i : i + 5000])
            )
        ):
            p.keys[fid] = (name, filename, first)
            p.lines[fid] = (line_number, line)
            p.ids[(name, filename, first)] = fid
    for fid in ids:  # a frame removed under us: still drawn, unnamed
        if fid not in p.keys:
            p.keys[fid] = ("?", "", 0)
            p.lines[fid] = (0, "")
    p._next = max(p.keys, default=-1) + 1
    return p


def decode(db: Session, tenant_id: int, data: bytes) -> Profile:
    p = Profile()
    decode_into(p, data)
    return resolve(db, tenant_id, p)


@dataclass
class RunProfiles:
    """A run's trees by (prefix, worker), before the merged rows are derived."""

    trees: dict[tuple[str, str], Profile] = field(default_factory=dict)
    events: int = 0


#: The tasks' columns :func:`windows` reads.
WINDOW_COLUMNS = ["worker", "prefix", "compute_start", "compute_stop"]


def windows(tasks: Any) -> dict[tuple[str, str], tuple[float, float]]:
    """Per (worker, prefix): the first compute start and last compute stop of a run's
    tasks (``tasks`` is the run's Arrow table, as ``storage.runs.runfile`` builds it, or
    its :class:`RunData`, whose tasks are then read a row group at a time)."""
    import pyarrow.compute as pc

    parts = (
        tasks.parts("tasks", WINDOW_COLUMNS)
        if isinstance(tasks, RunData)
        else [tasks.select(WINDOW_COLUMNS)]
    )
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for t in parts:
        t = t.filter(pc.is_valid(t["compute_start"]))
        if t.num_rows == 0:
            continue
        g = t.group_by(["worker", "prefix"]).aggregate(
            [("compute_start", "min"), ("compute_stop", "max")]
        )
        for w, p, lo, hi in zip(
            g["worker"].to_pylist(),
            g["prefix"].to_pylist(),
            g["compute_start_min"].to_pylist(),
            g["compute_stop_max"].to_pylist(),
            strict=True,
        ):
            key = (w or "", p or "")
            was = out.get(key)
            out[key] = (lo, hi) if was is None else (min(was[0], lo), _max(was[1], hi))
    return out


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def attribute(
    windows_: dict[tuple[str, str], tuple[float, float]], events: Iterable[Any]
) -> RunProfiles:
    """The run's trees from ``events`` (any events; profile events whose cycle overlaps
    the run's window for their worker and prefix are taken)."""
    out = RunProfiles()
    for ev in events:
        if type(ev) is not ProfileEvent:
            continue
        w = windows_.get((ev.worker, ev.prefix))
        if w is None or ev.start > w[1] or ev.stop < w[0]:
            continue
        key = (ev.prefix, ev.worker)
        tree = out.trees.get(key)
        if tree is None:
            tree = out.trees[key] = Profile(interval=ev.interval)
        if add_event(tree, ev):
            out.events += 1
    return out


@dataclass
class Row:
    """One ``run_profiles`` row before it is stored: its key and its (pruned) tree."""

    prefix: str
    worker: str
    tree: Profile


def rows(built: RunProfiles) -> list[Row]:
    """A run's rows: per (prefix, worker), per prefix, and the whole run, each pruned."""
    by_prefix: dict[str, Profile] = {}
    whole = Profile()
    out = []
    for (prefix, worker), tree in sorted(built.trees.items()):
        merged = by_prefix.get(prefix)
        if merged is None:
            merged = by_prefix[prefix] = Profile(interval=tree.interval)
        merge_into(merged, tree)
        merge_into(whole, tree)
        whole.interval = tree.interval
        prune(tree, MAX_WORKER_NODES)
        out.append(Row(prefix, worker, tree))
    for prefix, tree in by_prefix.items():
        prune(tree, MAX_NODES)
        out.append(Row(prefix, "", tree))
    prune(whole, MAX_NODES)
    out.append(Row("", "", whole))
    return out


def _worker_batches(db: Session, run: m.Run) -> list[tuple[int, str]]:
    """(id, blob key) of the session's worker batches received in the run's window."""

    return runfile.session_batches_around(
        db, run, WINDOW_SLACK_S, agents=m.Agent.name.like("worker-%")
    )


def inputs_tag(db: Session, run: m.Run, batches: list[tuple[int, str]]) -> str:
    """The version of what a run's profile is built from: its own batches (their count
    and highest id) and the worker batches in its window."""
    n, hi = packed.batch_tag(db, run.id)
    return f"{FORMAT}/{n}-{hi}/{len(batches)}-{batches[-1][0] if batches else 0}"


def build(tasks: Any, events: Iterable[Any]) -> list[Row]:
    """A run's profile rows from its task table (or :class:`RunData`) and candidate
    events."""
    return rows(attribute(windows(tasks), events))


def store(db: Session, run: m.Run, new_rows: list[Row], tag: str) -> None:
    """Replace a run's stored profile (the caller owns the transaction).

    Upserts, then removes rows of other builds: a finisher and a first read building the
    same run at once both succeed (whichever commits last wins, and a stale tag is
    rebuilt on the next read) instead of one failing on the primary key."""
    frames: dict[FrameKey, tuple[int, str]] = {}
    for r in new_rows:
        for fid in r.tree.frame_ids():
            frames.setdefault(r.tree.keys[fid], r.tree.lines[fid])
    ids = frame_ids(db, run.tenant_id, frames)
    values = []
    for r in new_rows:
        global_ids = {fid: ids[key] for fid, key in r.tree.keys.items() if key in ids}
        values.append(
            {
                "run_id": run.id,
                "prefix": r.prefix,
                "worker": r.worker,
                "samples": r.tree.samples,
                "nodes": r.tree.size(),
                "interval": r.tree.interval,
                "tag": tag,
                "data": encode(r.tree, global_ids),
            }
        )
    P = m.RunProfile.__table__
    if values:
        ins = _insert(db)(P)
        db.execute(
            ins.on_conflict_do_update(
                index_elements=["run_id", "prefix", "worker"],
                set_={c: ins.excluded[c] for c in ("samples", "nodes", "interval", "tag", "data")},
            ),
            sorted(values, key=lambda v: (v["prefix"], v["worker"])),
        )
    db.execute(delete(P).where(P.c.run_id == run.id, P.c.tag != tag))


def _insert(db: Session) -> Any:
    if db.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


def finish(fr: FinishedRun) -> None:
    """Finisher (``storage.jobs.finish``): build and store a finished run's profile.
    Idempotent: the rows are replaced whole."""
    batches = _worker_batches(fr.db, fr.run)
    events = (ev for batch in fr.batches() for ev in batch.events)
    # the tasks' windows from their columns a row group at a time, not the whole table
    store(fr.db, fr.run, build(fr.data(), events), inputs_tag(fr.db, fr.run, batches))


def _events(blobs: BlobStore, batches: list[tuple[int, str]]) -> Iterator[Any]:
    for _id, key in batches:
        try:
            batch = decode_stored(blobs.get(key))
        except FileNotFoundError:
            continue  # removed by retention since the index was read
        yield from batch.events


def _index_has(db: Session, run: m.Run) -> dict[tuple[str, str], Any]:
    P = m.RunProfile
    return {
        (p, w): (samples, t)
        for p, w, samples, t in db.execute(
            select(P.prefix, P.worker, P.samples, P.tag).where(P.run_id == run.id)
        )
    }


def ensure(db: Session, blobs: BlobStore, run: m.Run) -> dict[tuple[str, str], Any] | None:
    """The run's stored profile rows by (prefix, worker) without their data, building
    them first if they are missing or stale. A running run's profile is built but not
    stored: None then, and :func:`load` builds it in memory. Rows are read from the index,
    or from the run's detail object (``storage.runs.detail``) once they moved there."""

    batches = _worker_batches(db, run)
    tag = inputs_tag(db, run, batches)
    have = _index_has(db, run)
    if not have:
        stored = detail.read(db, blobs, run)
        if stored is not None:
            have = {(r.prefix, r.worker): (r.samples, r.tag) for r in stored.profiles}
    marker = have.get(("", ""))
    if marker is not None and marker[1] == tag:
        return have
    if run.status == "running":
        return None
    data = runfile.load_run(db, blobs, run)
    new_rows = build(data.tasks, _events(blobs, batches))
    # Derived data, written in its own transaction (as a finisher would): the caller's
    # session stays a reader. A run whose detail is in an object already gets a new
    # version of it (a later run's worker batches made its profile stale), so the rows
    # do not come back into the index; the version the caller may be reading stays.
    digest = run.detail_digest
    try:
        with Session(db.get_bind()) as writer, writer.begin():
            store(writer, run, new_rows, tag)
            own = writer.get(m.Run, run.id) if run.detail_digest is not None else None
            if own is not None:
                detail.store(writer, blobs, own)
                digest = own.detail_digest
        if run.detail_digest is not None and digest != run.detail_digest:
            # the reader's copy of the run names the new version (not a change to flush)
            previous = run.detail_digest
            set_committed_value(run, "detail_digest", digest)
            detail.prune_versions(db, blobs, run, previous)
    except (IntegrityError, DBAPIError):
        # Another request stored it at the same time, or the index is busy: the rows
        # built here are as good; they are stored next time.
        logger.info("profile of run %s not stored (concurrent build)", run.public_id)
    return {(r.prefix, r.worker): (r.tree.samples, tag) for r in new_rows}


def _wanted(prefix: str | None, worker: str | None) -> Callable[[str, str], bool]:
    """Which stored rows make the profile of ``prefix`` and/or ``worker``."""
    if worker is None:
        return lambda p, w: p == (prefix or "") and w == ""
    if prefix is not None:
        return lambda p, w: p == prefix and w == worker
    return lambda p, w: p != "" and w == worker


def _from_object(db: Session, blobs: BlobStore, run: m.Run, want: Any) -> Profile | None:
    """The merge of the run's detail object's trees ``want(prefix, worker)`` accepts, or
    None when the index holds the run's rows (or it has no object)."""
    P = m.RunProfile
    if db.execute(select(P.run_id).where(P.run_id == run.id).limit(1)).first() is not None:
        return None
    stored = detail.read(db, blobs, run)
    if stored is None:
        return None
    out = Profile()
    for row, tree in detail.profile_trees(stored, lambda r: want(r.prefix, r.worker)):
        merge_into(out, tree)
        out.interval = row.interval
    return out


def _live(db: Session, blobs: BlobStore, run: m.Run) -> RunProfiles:
    """A running run's trees, built in memory from what has arrived so far."""

    tasks = runfile.load_run(db, blobs, run).tasks
    return attribute(windows(tasks), _events(blobs, _worker_batches(db, run)))


def load(
    db: Session, blobs: BlobStore, run: m.Run, prefix: str | None = None, worker: str | None = None
) -> Profile:
    """A run's profile, optionally of one prefix and/or one worker."""
    have = ensure(db, blobs, run)
    if have is None:
        out = Profile()
        for (p, w), tree in _live(db, blobs, run).trees.items():
            if (prefix is None or p == prefix) and (worker is None or w == worker):
                merge_into(out, tree)
                out.interval = tree.interval
        return _named(db, run, out)
    want = _wanted(prefix, worker)
    moved = _from_object(db, blobs, run, want)
    if moved is not None:
        return _named(db, run, moved)
    P = m.RunProfile
    if worker is None:
        where = [P.prefix == (prefix or ""), P.worker == ""]
    elif prefix is not None:
        where = [P.prefix == prefix, P.worker == worker]
    else:
        where = [P.prefix != "", P.worker == worker]
    found = db.execute(select(P.data).where(P.run_id == run.id, *where)).scalars()
    return _named(db, run, resolve(db, run.tenant_id, merge_stored(found)))


def _named(db: Session, run: m.Run, *trees: Profile) -> Profile:
    """``trees`` (the first returned) with the run's functions shipped by value named by
    the file the submitting code holds them in, not cloudpickle's ``<dynamic-code>``."""
    if any(k[1] == DYNAMIC_FILE for t in trees for k in t.keys.values()):
        sources = [
            (f["filename"], f["code"], f["lineno_frame"] - f["lineno_relative"])
            for submission in run_code(db, run.id)
            for f in submission["frames"]
            if f.get("code") and f.get("filename")
        ]
        for tree in trees:
            name_dynamic_frames(tree, sources)
    return trees[0]


@dataclass
class Merged:
    """A profile merged over runs: the tree, how many runs it holds, and whether more
    runs matched than were merged (the newest ``limit`` are)."""

    profile: Profile
    runs: int
    truncated: bool


def across_runs(
    db: Session,
    tenant_id: int,
    *,
    prefix: str | None = None,
    name: str | None = None,
    cluster: str | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int = MAX_RUNS,
    blobs: BlobStore | None = None,
) -> Merged:
    """The merged profile of ``prefix`` (or of whole runs) over the runs started in
    ``[since, until)``, optionally only those named ``name`` or of ``cluster``: one stored
    tree per run, newest runs first."""
    P, R = m.RunProfile, m.Run
    stored = (
        select(P.data)
        .where(P.run_id == R.id, P.prefix == (prefix or ""), P.worker == "")
        .scalar_subquery()
    )
    q = select(R.id, R.public_id, R.session_id, R.detail_digest, stored.label("data")).where(
        R.tenant_id == tenant_id
    )
    # Runs with a stored tree in the index, or with a detail object (which may hold one).
    q = q.where(or_(stored.is_not(None), R.detail_digest.is_not(None)))
    if name is not None:
        q = q.where(R.name == name)
    if cluster is not None:
        q = q.join(m.Cluster, m.Cluster.id == R.cluster_id).where(m.Cluster.name == cluster)
    if since is not None:
        q = q.where(R.started_at >= since)
    if until is not None:
        q = q.where(R.started_at < until)
    found = db.execute(q.order_by(R.started_at.desc(), R.id.desc()).limit(limit + 1)).all()
    from_index = merge_stored(row.data for row in found[:limit] if row.data is not None)
    out = resolve(db, tenant_id, from_index)
    runs = sum(1 for row in found[:limit] if row.data is not None)
    if blobs is not None:
        want = prefix or ""
        for row in found[:limit]:
            if row.data is not None:
                continue
            run = db.get(R, row.id)
            stored_detail = detail.read(db, blobs, run) if run is not None else None
            if stored_detail is None:
                continue
            trees = detail.profile_trees(
                stored_detail, lambda r: r.prefix == want and r.worker == ""
            )
            for prow, tree in trees:
                merge_into(out, tree)
                out.interval = prow.interval
            runs += bool(trees)
    return Merged(out, runs, len(found) > limit)


def load_prefixes(db: Session, blobs: BlobStore, run: m.Run) -> dict[str, Profile]:
    """A run's profile per task prefix (over all its workers)."""
    have = ensure(db, blobs, run)
    out: dict[str, Profile] = {}
    if have is None:
        for (prefix, _worker), tree in _live(db, blobs, run).trees.items():
            merged = out.setdefault(prefix, Profile(interval=tree.interval))
            merge_into(merged, tree)
        if out:
            _named(db, run, *out.values())
        return out
    P = m.RunProfile
    for prefix, data in db.execute(
        select(P.prefix, P.data).where(P.run_id == run.id, P.prefix != "", P.worker == "")
    ):
        out[prefix] = decode(db, run.tenant_id, data)
    if not out:
        stored = detail.read(db, blobs, run)
        if stored is not None:
            for row, tree in detail.profile_trees(stored, lambda r: r.prefix and not r.worker):
                out[row.prefix] = tree
    if out:
        _named(db, run, *out.values())
    return out
