"""Commits to the history lake: one partition's manifest, files and merges.

Layout, manifest format and filters: ``hindsight/lake.py``. What goes in (a run's rows) and
when: ``storage/lake/build.py``.

**A commit** to a (tenant, cluster, day) partition: under the partition's row lock in the
index, read the newest manifest from the blob store (the truth), write the new files,
then put manifest ``seq + 1`` with put-if-absent. Put-if-absent is the fence: a writer that
lost its lock (or a second writer without one) cannot overwrite a commit; it re-reads and
tries again. Files are never modified: a run that changes, or goes, makes the files that
held it superseded (listed under ``removed`` with the time) and the rows of the other runs
in them are rewritten into new files. Superseded files are deleted once ``GRACE_S`` has
passed, so a reader holding an older manifest (a Dask graph planned a minute ago) still
finds every file it planned. File names carry the commit's ``seq``, so no two commits ever
write the same name and deleting a superseded file can never hit a live one. Only then is
the index's copy of the catalog (``lake_partitions``, ``lake_files``, ``lake_runs``)
updated, in the caller's transaction: if that rolls back, the blob store is ahead and the
next commit (or the retried finisher) catches the index up.

**Merging.** A run's rows are written with the rows they are merged with, never written
small and then rewritten at once: per table, when the partition already holds
``FANOUT - 1`` small files of the new file's size tier or below (tiers by rows, x4 apart),
they are merged with it; once the partition's day is over (it is before today, UTC), every
small file is merged into one (sealing). A cluster's day thus ends as one file per table
(or a few of ``TARGET_ROWS`` each), and while the day runs, each row is rewritten about
log4(rows of the day) times. Merges stream row groups: memory stays near ``ROW_GROUP`` rows.
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import Session

from hindsight import lake as layout
from hindsight.lake import FileEntry, Manifest, Removed, RunEntry
from storage.core import models as m
from storage.core.blobs import BlobStore

logger = logging.getLogger(__name__)

ROW_GROUP = 131_072
#: Rows of a full file per table (~50-150 MB of Parquet for tasks); a file of at least half
#: is never merged again.
TARGET_ROWS = {"tasks": 1_000_000, "metrics": 4_000_000, "runs": 1_000_000, "streams": 1_000_000}
BASE_ROWS = 16_384  # files below this are tier 0; each tier above holds FANOUT x more rows
FANOUT = 4
#: Seconds a superseded file stays readable before it is deleted.
GRACE_S = 3600.0
MAX_ATTEMPTS = 5
SORT_KEYS = {
    "tasks": [("prefix", "ascending"), ("start", "ascending")],
    "metrics": [("name", "ascending"), ("worker", "ascending"), ("time", "ascending")],
    "runs": [("started_at", "ascending")],
    "streams": [("stream", "ascending"), ("time", "ascending")],
}


def schemas() -> dict[str, Any]:
    """The Arrow schema of each lake table (``hindsight.lake.COLUMNS``)."""
    return {t: layout.schema(t) for t in layout.TABLES}


@dataclass
class RunRows:
    """One run's rows for the lake; ``load`` builds the tables only when a commit needs them."""

    run: str  # public id
    session: str
    tag: str
    load: Callable[[], dict[str, Any]]

    @cached_property
    def tables(self) -> dict[str, Any]:
        return self.load()


# ---------------------------------------------------------------- statistics


def _stats(table_name: str, t: Any) -> dict[str, Any]:
    """What pruning needs to know of a chunk of rows (see docs/lake.md)."""
    import pyarrow.compute as pc

    if table_name == "tasks":
        g = t.group_by("prefix").aggregate(
            [("prefix", "count"), ("duration", "max"), ("nbytes", "max")]
        )
        erred = _counts(t.filter(pc.equal(t["status"], "erred"))["prefix"])
        prefixes = {
            p: [n, mc or 0.0, mb or 0, erred.get(p, 0)]
            for p, n, mc, mb in zip(
                g["prefix"].to_pylist(),
                g["prefix_count"].to_pylist(),
                g["duration_max"].to_pylist(),
                g["nbytes_max"].to_pylist(),
                strict=True,
            )
            if p is not None
        }
        return {"prefixes": prefixes, "statuses": _counts(t["status"])}
    if table_name == "metrics":
        return {"names": _counts(t["name"])}
    if table_name == "streams":
        return {"streams": _counts(t["stream"])}
    return {}


def _counts(col: Any) -> dict[str, int]:
    vc = col.value_counts()
    return {
        str(v): int(c)
        for v, c in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist(), strict=True)
        if v is not None
    }


def _merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in set(a) | set(b):
        x, y = a.get(k, {}), b.get(k, {})
        if k == "prefixes":
            merged = dict(x)
            for p, (n, mc, mb, e) in y.items():
                if p in merged:
                    n0, mc0, mb0, e0 = merged[p]
                    merged[p] = [n0 + n, max(mc0, mc), max(mb0, mb), e0 + e]
                else:
                    merged[p] = [n, mc, mb, e]
            out[k] = merged
        else:
            out[k] = {n: x.get(n, 0) + y.get(n, 0) for n in set(x) | set(y)}
    return out


def _span(table_name: str, t: Any) -> tuple[float | None, float | None]:
    import pyarrow.compute as pc

    lo_col, hi_col = layout.TIME_COLUMNS[table_name]
    return pc.min(t[lo_col]).as_py(), pc.max(t[hi_col]).as_py()


# ---------------------------------------------------------------- writing files


def parquet_options(schema: Any) -> dict[str, Any]:
    """How lake files are encoded: zstd; floats (times, seconds, values) byte-stream-split
    rather than dictionary-encoded, which takes a task record from ~65 to ~49 bytes and
    writes faster (measured on bench/lake.py's records); dictionaries for the rest."""
    import pyarrow as pa

    floats = [f.name for f in schema if f.type == pa.float64()]
    others = [f.name for f in schema if f.type != pa.float64()]
    return {"compression": "zstd", "use_dictionary": others, "use_byte_stream_split": floats}


class _FileWriter:
    """Writes one table's rows of a commit into files of at most ``TARGET_ROWS`` rows,
    row groups sorted, statistics gathered as it goes."""

    def __init__(
        self, blobs: BlobStore, part: Partition, table: str, seq: int, tags: dict[str, str]
    ) -> None:
        self.blobs, self.part, self.table, self.seq, self.tags = blobs, part, table, seq, tags
        self.schema = schemas()[table]
        self.entries: list[FileEntry] = []
        self._pending: list[Any] = []
        self._pending_rows = 0
        self._open()

    def _open(self) -> None:
        import pyarrow.parquet as pq

        self._buf = io.BytesIO()
        self._writer = pq.ParquetWriter(self._buf, self.schema, **parquet_options(self.schema))
        self._rows = 0
        self._runs: set[str] = set()
        self._stats: dict[str, Any] = {}
        self._t: list[float | None] = [None, None]

    def add(self, t: Any) -> None:
        if len(t) == 0:
            return
        self._pending.append(t.cast(self.schema) if t.schema != self.schema else t)
        self._pending_rows += len(t)
        if self._pending_rows >= ROW_GROUP:
            self._flush_group()

    def _flush_group(self) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        if not self._pending:
            return
        t = pa.concat_tables(self._pending).sort_by(SORT_KEYS[self.table])
        self._pending, self._pending_rows = [], 0
        self._writer.write_table(t, row_group_size=ROW_GROUP)
        self._rows += len(t)
        self._runs.update(x for x in pc.unique(t["run"]).to_pylist() if x is not None)
        self._stats = _merge_stats(self._stats, _stats(self.table, t))
        lo, hi = _span(self.table, t)
        if lo is not None and (self._t[0] is None or lo < self._t[0]):
            self._t[0] = lo
        if hi is not None and (self._t[1] is None or hi > self._t[1]):
            self._t[1] = hi
        if self._rows >= TARGET_ROWS[self.table]:
            self._close()
            self._open()

    def _close(self) -> None:
        self._writer.close()
        if self._rows == 0:
            return
        runs = sorted(self._runs)
        h = hashlib.sha256(self.table.encode())
        for r in runs:
            h.update(f"\n{r}@{self.tags.get(r, '')}".encode())
        h.update(f"\n#{len(self.entries)}".encode())
        name = f"part-{self.seq:010d}-{h.hexdigest()[:16]}.parquet"
        key = f"{layout.partition_dir(self.table, *self.part.names)}/{name}"
        body = self._buf.getvalue()
        self.blobs.put(key, body, if_absent=True)
        self.entries.append(
            FileEntry(
                self.table, key, self._rows, len(body), runs, self._t[0], self._t[1], self._stats
            )
        )

    def finish(self) -> list[FileEntry]:
        self._flush_group()
        self._close()
        return self.entries


def _file_rows(blobs: BlobStore, entry: FileEntry, drop: set[str]) -> Iterator[Any]:
    """The row groups of a lake file, without the runs in ``drop``."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    f = pq.ParquetFile(io.BytesIO(blobs.get(entry.key)))
    keep = None
    for i in range(f.metadata.num_row_groups):
        t = f.read_row_group(i)
        if drop:
            if keep is None:
                keep = [r for r in entry.runs if r not in drop]
            t = t.filter(pc.is_in(t["run"], value_set=_str_array(keep)))
        yield t


def _str_array(values: list[str]) -> Any:
    import pyarrow as pa

    return pa.array(values, pa.string())


def _tier(rows: int) -> int:
    tier, cap = 0, BASE_ROWS
    while rows >= cap:
        tier += 1
        cap *= FANOUT
    return tier


def _full(table: str, rows: int) -> bool:
    return rows >= TARGET_ROWS[table] // 2


# ---------------------------------------------------------------- commits


@dataclass
class Partition:
    tenant: str
    cluster: str
    day: str
    tenant_id: int
    cluster_id: int

    @property
    def names(self) -> tuple[str, str, str]:
        return self.tenant, self.cluster, self.day

    def __str__(self) -> str:
        return "/".join(self.names)


@dataclass
class _TablePlan:
    sources: list[Any] = field(default_factory=list)  # FileEntry (rewritten) or Arrow tables
    superseded: list[FileEntry] = field(default_factory=list)
    drop: set[str] = field(default_factory=set)


def read_manifest(blobs: BlobStore, tenant: str, cluster: str, day: str) -> Manifest:
    """The partition's newest manifest (an empty one if it has none)."""
    prefix = layout.manifest_dir(tenant, cluster, day) + "/"
    for _ in range(MAX_ATTEMPTS):
        latest = layout.latest_manifests(blobs.list(prefix))
        if not latest:
            return layout.empty_manifest(tenant, cluster, day)
        try:
            return layout.decode_manifest(blobs.get(next(iter(latest.values()))))
        except FileNotFoundError:  # superseded while we listed: list again
            continue
    raise ConnectionError(f"lake partition {tenant}/{cluster}/{day} keeps changing")


def _dialect_insert(db: Session) -> Any:
    if db.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    return dialect_insert


def _lock(db: Session, part: Partition) -> int:
    """The partition's index row, locked until the caller's transaction ends."""
    P = m.LakePartition
    db.execute(
        _dialect_insert(db)(P)
        .values(tenant_id=part.tenant_id, cluster_id=part.cluster_id, day=part.day, seq=0)
        .on_conflict_do_nothing(index_elements=["cluster_id", "day"])
    )
    return db.scalars(
        select(P.id).where(P.cluster_id == part.cluster_id, P.day == part.day).with_for_update()
    ).one()


def commit(
    db: Session,
    blobs: BlobStore,
    part: Partition,
    *,
    add: Iterable[RunRows] = (),
    remove: Iterable[str] = (),
    remove_session: str | None = None,
    now: float | None = None,
    grace: float = GRACE_S,
    seal: bool | None = None,
) -> Manifest:
    """Put runs into (``add``: new or changed versions) and take runs out of (``remove``,
    or every run of ``remove_session``) one partition, merging files as the policy says.
    Superseded files are deleted after ``grace`` seconds (0: at once, for retention).
    Returns the committed manifest (the old one if nothing changed)."""
    now = time.time() if now is None else now
    add = list(add)
    remove = set(remove)
    pid = _lock(db, part)
    if seal is None:
        seal = part.day < layout.day_of(now)
    for _attempt in range(MAX_ATTEMPTS):
        base = read_manifest(blobs, *part.names)
        new = _next_manifest(blobs, part, base, add, remove, remove_session, now, grace, seal)
        if new is None:
            _sync(db, pid, part, base, grace)
            return base
        manifest, delete_now = new
        if blobs.put(
            layout.manifest_key(*part.names, manifest.seq),
            layout.encode_manifest(manifest),
            if_absent=True,
        ):
            break
        logger.warning("lake: %s changed under commit %d; retrying", part, manifest.seq)
    else:
        raise ConnectionError(f"lake partition {part} kept changing; commit abandoned")
    for key in delete_now:
        blobs.delete(key)
    for key in blobs.list(layout.manifest_dir(*part.names) + "/"):
        parsed = layout.parse_manifest_key(key)
        # Keep the previous manifest: a reader may have listed it a moment ago.
        if parsed and (parsed[3] < manifest.seq - 1 or _empty(manifest)):
            blobs.delete(key)
    _sync(db, pid, part, manifest, grace)
    return manifest


def _empty(manifest: Manifest) -> bool:
    return not (manifest.runs or manifest.files or manifest.removed)


def _next_manifest(
    blobs: BlobStore,
    part: Partition,
    base: Manifest,
    add: list[RunRows],
    remove: set[str],
    remove_session: str | None,
    now: float,
    grace: float,
    seal: bool,
) -> tuple[Manifest, list[str]] | None:
    """The manifest after the change (files written), and the keys to delete once it is
    committed; None if nothing changes."""
    changed = [r for r in add if (e := base.runs.get(r.run)) is None or e.tag != r.tag]
    gone = {r for r in remove if r in base.runs}
    if remove_session is not None:
        gone |= {r for r, e in base.runs.items() if e.session == remove_session}
    drop = {r.run for r in changed} | gone
    cutoff = now - grace
    due = [r for r in base.removed if r.at <= cutoff]
    plans: dict[str, _TablePlan] = {}
    for table in layout.TABLES:
        live = [f for f in base.files if f.table == table]
        plan = _TablePlan(drop=drop)
        touched = [f for f in live if drop & set(f.runs)]
        untouched = [f for f in live if not drop & set(f.runs)]
        plan.superseded += touched
        plan.sources += [f for f in touched if set(f.runs) - drop]
        plan.sources += [r.tables[table] for r in changed if len(r.tables[table])]
        small = [f for f in untouched if not _full(table, f.rows)]
        merge = _choose_merges(table, plan.sources, small, seal)
        plan.superseded += merge
        plan.sources += merge
        if plan.sources or plan.superseded:
            plans[table] = plan
    if not plans and not gone and not due and not changed:
        return None
    seq = base.seq + 1
    runs = {r: e for r, e in base.runs.items() if r not in drop}
    runs.update({r.run: RunEntry(r.tag, r.session) for r in changed})
    tags = {r: e.tag for r, e in runs.items()}
    files = list(base.files)
    superseded: list[FileEntry] = []
    for table, plan in plans.items():
        writer = _FileWriter(blobs, part, table, seq, tags)
        for src in plan.sources:
            if isinstance(src, FileEntry):
                try:
                    for t in _file_rows(blobs, src, plan.drop):
                        writer.add(t)
                except FileNotFoundError:
                    # Lost out of band: its runs leave the lake until finished again
                    # (reindex finishes every run).
                    logger.error("lake: %s is missing; dropping its runs %s", src.key, src.runs)
                    for r in src.runs:
                        runs.pop(r, None)
            else:
                writer.add(src)
        written = writer.finish()
        old = {f.key for f in plan.superseded}
        files = [f for f in files if f.key not in old] + written
        superseded += plan.superseded
    removed = [r for r in base.removed if r.at > cutoff]
    delete_now = [r.key for r in due]
    if grace <= 0:
        delete_now += [f.key for f in superseded]
    else:
        removed += [Removed(f.key, now) for f in superseded]
    manifest = Manifest(
        "hindsight-lake", layout.LAKE_VERSION, *part.names, seq, now, runs, files, removed
    )
    return manifest, delete_now


def _choose_merges(
    table: str, sources: list[Any], small: list[FileEntry], seal: bool
) -> list[FileEntry]:
    """The untouched small files to merge into this commit's new file of ``table``."""
    if seal:
        # The day is over: one file (if more than one would otherwise stay).
        return small if (sources and small) or len(small) > 1 else []
    if not sources:
        return []
    rows = sum(s.rows if isinstance(s, FileEntry) else len(s) for s in sources)
    chosen: list[FileEntry] = []
    while True:
        tier = _tier(rows)
        candidates = [f for f in small if f not in chosen and _tier(f.rows) <= tier]
        if len(candidates) < FANOUT - 1:
            return chosen
        chosen += candidates
        rows += sum(f.rows for f in candidates)


def _sync(db: Session, pid: int, part: Partition, manifest: Manifest, grace: float) -> None:
    """Make the index's catalog of the partition what ``manifest`` says."""
    P, F, LR = m.LakePartition, m.LakeFile, m.LakeRun
    if _empty(manifest):
        db.execute(delete(P).where(P.id == pid))
        return
    vacuum_at = min((r.at for r in manifest.removed), default=None)
    db.execute(
        update(P)
        .where(P.id == pid)
        .values(seq=manifest.seq, vacuum_at=None if vacuum_at is None else vacuum_at + grace)
    )
    db.execute(delete(F).where(F.partition_id == pid))
    if manifest.files:
        db.execute(
            insert(F),
            [
                {
                    "partition_id": pid,
                    "tbl": f.table,
                    "key": f.key,
                    "rows": f.rows,
                    "bytes": f.bytes,
                    "t_min": f.t_min,
                    "t_max": f.t_max,
                    "runs": f.runs,
                    "stats": f.stats,
                }
                for f in manifest.files
            ],
        )
    ids = dict(
        db.execute(
            select(m.Run.public_id, m.Run.id).where(
                m.Run.tenant_id == part.tenant_id, m.Run.public_id.in_(list(manifest.runs))
            )
        ).all()
    )
    want = {ids[r]: e.tag for r, e in manifest.runs.items() if r in ids}
    have_runs = dict(db.execute(select(LR.run_id, LR.tag).where(LR.partition_id == pid)).all())
    stale = [r for r, tag in have_runs.items() if want.get(r) != tag]
    fresh = [r for r, tag in want.items() if have_runs.get(r) != tag]
    if stale or fresh:
        db.execute(delete(LR).where(LR.run_id.in_(stale + fresh)))
    if fresh:
        db.execute(insert(LR), [{"run_id": r, "partition_id": pid, "tag": want[r]} for r in fresh])
