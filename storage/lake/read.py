"""Scans of the history lake for the query service.

A scan is planned from the index's copy of the lake catalog (``lake_files``: one indexed
query by tenant, table, cluster and day, however many partitions there are), pruned by
each file's statistics (time span, runs, and per prefix its rows, longest duration and
largest result, statuses, metric and stream names), then read in parallel from the blob
store with the row filter pushed into the Parquet reader (row groups whose statistics
cannot match are skipped). A sort on duration or bytes, descending, reads files in
the order of their statistics and stops as soon as no unread file can hold a row of the
answer: "the 100 slowest tasks of a prefix over 30 days" opens a handful of files, not all.

The planner trusts the index's catalog; if a file it names is gone (the catalog lagging
the manifests after a rolled-back commit, or a superseded file past its grace period), the
scan is planned again from the partitions' manifests in the blob store and restarts once.
"""

from __future__ import annotations

import io
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sqlalchemy import literal, or_, select
from sqlalchemy.orm import Session

from hindsight import lake as layout
from hindsight.lake import FileEntry, Filters
from storage.core import models as m
from storage.core.blobs import BlobStore, LocalBlobStore
from storage.lake.write import read_manifest

logger = logging.getLogger(__name__)

IO_THREADS = 8
#: Per table, the sorts a file's statistics bound (column -> index in stats["prefixes"]).
_BOUNDED_SORTS = {("tasks", "duration"): 1, ("tasks", "nbytes"): 2}


@dataclass
class PlannedFile:
    """A file a scan reads, with its partition."""

    cluster: str
    day: str
    entry: FileEntry

    @property
    def name(self) -> str:
        return self.entry.key.rsplit("/", 1)[1]


@dataclass
class Sort:
    column: str
    descending: bool


@dataclass
class ScanResult:
    table: Any  # pyarrow.Table
    files_planned: int
    files_opened: int
    rows_in_opened_files: int
    truncated: bool


def plan(db: Session, tenant_id: int, table: str, filters: Filters) -> list[PlannedFile]:
    """The files of the tenant's ``table`` that ``filters`` may match (partition and
    statistics pruning), in partition order."""
    filters.check(table)
    F, P, C = m.LakeFile, m.LakePartition, m.Cluster
    # A file's run list is only read for a run filter (decoding 1,500 of them is ~30% of
    # planning a month of a 50-cluster lake).
    runs_col = F.runs if filters.run else literal(None)
    q = (
        select(C.name, P.day, F.key, F.rows, F.bytes, F.t_min, F.t_max, runs_col, F.stats)
        .join(P, P.id == F.partition_id)
        .join(C, C.id == P.cluster_id)
        .where(P.tenant_id == tenant_id, F.tbl == table)
        .order_by(P.day, C.name, F.key)
    )
    if filters.cluster:
        q = q.where(C.name.in_(filters.cluster))
    if filters.until is not None:
        # A run's rows live in the partition of the day it started, before any of them.
        q = q.where(P.day <= layout.day_of(filters.until))
        q = q.where(or_(F.t_min.is_(None), F.t_min < filters.until))
    if filters.since is not None:
        q = q.where(or_(F.t_max.is_(None), F.t_max >= filters.since))
    if filters.run:
        q = q.where(
            P.id.in_(
                select(m.LakeRun.partition_id)
                .join(m.Run, m.Run.id == m.LakeRun.run_id)
                .where(m.Run.tenant_id == tenant_id, m.Run.public_id.in_(filters.run))
            )
        )
    out = []
    for cluster, day, key, rows, nbytes, t_min, t_max, runs, stats in db.execute(q):
        entry = FileEntry(table, key, rows, nbytes, runs or [], t_min, t_max, stats or {})
        if filters.file_may_match(entry):
            out.append(PlannedFile(cluster, day, entry))
    return out


def replan(
    blobs: BlobStore, tenant: str, table: str, filters: Filters, files: Sequence[PlannedFile]
) -> list[PlannedFile]:
    """``files`` planned again from the manifests of their partitions (the truth)."""
    out = []
    for cluster, day in sorted({(f.cluster, f.day) for f in files}):
        manifest = read_manifest(blobs, tenant, cluster, day)
        out += [PlannedFile(cluster, day, e) for e in layout.plan([manifest], table, filters)]
    return out


def read_file(
    blobs: BlobStore, f: PlannedFile, table: str, filters: Filters, columns: Sequence[str]
) -> Any:
    """One file's rows matching ``filters``: its ``columns`` (all if empty), with the
    partition columns (cluster, day) where asked."""
    import pyarrow.parquet as pq

    # A local file is read in place (only the column chunks asked for; memory-mapping such
    # small files measured slower), from S3 whole.
    source = blobs.path(f.entry.key) if isinstance(blobs, LocalBlobStore) else None
    t = pq.read_table(
        str(source) if source is not None else io.BytesIO(blobs.get(f.entry.key)),
        columns=layout.stored_columns(columns),
        filters=filters.expression(table),
    )
    return layout.with_partition_columns(t, f.cluster, f.day, columns)


def _bounded_map(fn: Callable[[Any], Any], items: Sequence[Any], ahead: int) -> Iterator[Any]:
    """``map(fn, items)`` on threads, in order, with at most ``ahead`` results in flight."""
    if not items:
        return
    with ThreadPoolExecutor(min(ahead, len(items)), thread_name_prefix="lake-read") as pool:
        pending: list[Future[Any]] = []
        it = iter(items)
        for item in it:
            pending.append(pool.submit(fn, item))
            if len(pending) >= ahead:
                break
        while pending:
            head = pending.pop(0)
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(fn, nxt))
            yield head.result()


def _bound(f: PlannedFile, sort: Sort, table: str, filters: Filters) -> float | None:
    """The largest value of the sort column any row of ``f`` can hold (None: unknown)."""
    index = _BOUNDED_SORTS.get((table, sort.column))
    prefixes = f.entry.stats.get("prefixes")
    if index is None or prefixes is None:
        return None
    wanted = (
        [prefixes[p] for p in filters.prefix if p in prefixes]
        if filters.prefix
        else prefixes.values()
    )
    return max((w[index] for w in wanted), default=float("-inf"))


def _top(t: Any, sort: Sort, k: int) -> Any:
    import pyarrow.compute as pc

    order = "descending" if sort.descending else "ascending"
    idx = pc.sort_indices(t, sort_keys=[(sort.column, order, "at_end")])
    return t.take(idx[:k])


def scan(
    blobs: BlobStore,
    files: Sequence[PlannedFile],
    table: str,
    filters: Filters,
    columns: Sequence[str],
    sort: Sort | None,
    limit: int,
) -> ScanResult:
    """The first ``limit`` rows (by ``sort``, else in plan order) of the files' rows
    matching ``filters``. Files are read ``IO_THREADS`` at a time; no file is started once
    it cannot change the answer (a bounded sort's next file cannot beat the current
    ``limit``-th row, or an unsorted answer is full)."""
    import pyarrow as pa

    read_cols = list(columns)
    if columns and sort is not None and sort.column not in columns:
        read_cols.append(sort.column)
    bounds: dict[int, float] = {}
    order = list(files)
    if sort is not None and sort.descending:
        known = [(f, _bound(f, sort, table, filters)) for f in files]
        if all(b is not None for _, b in known):
            known.sort(key=lambda fb: -fb[1])  # type: ignore[operator]
            order = [f for f, _ in known]
            bounds = {id(f): b for f, b in known}  # type: ignore[misc]
    # Rows buffered before a sorted answer is cut back to ``limit``: often when files can be
    # skipped by their bounds (each cut may stop the scan), else in large steps.
    reduce_at = 2 * limit if bounds else max(2 * limit, 65_536)
    acc: Any = None  # the answer so far (sorted and cut to ``limit`` when sorting)
    buffered: list[Any] = []
    buffered_rows = opened = rows_opened = 0
    kth: Any = None
    truncated = False

    def fold() -> None:
        nonlocal acc, buffered, buffered_rows, kth, truncated
        if not buffered:
            return
        acc = pa.concat_tables([acc, *buffered] if acc is not None else buffered)
        buffered, buffered_rows = [], 0
        if sort is not None:
            truncated = truncated or len(acc) > limit
            acc = _top(acc, sort, limit)
            if len(acc) >= limit:
                kth = acc[sort.column][limit - 1].as_py()

    def useless(f: PlannedFile) -> bool:
        if sort is None:
            return acc is not None and len(acc) >= limit
        return bool(bounds) and kth is not None and bounds[id(f)] <= kth

    with ThreadPoolExecutor(IO_THREADS, thread_name_prefix="lake-read") as pool:
        inflight: deque[Future[Any]] = deque()
        todo = deque(order)
        while todo or inflight:
            while todo and len(inflight) < IO_THREADS:
                if useless(todo[0]):
                    truncated = True  # unread files match too, but cannot join the answer
                    todo.clear()
                    break
                f = todo.popleft()
                inflight.append(pool.submit(read_file, blobs, f, table, filters, read_cols))
                opened += 1
                rows_opened += f.entry.rows
            if not inflight:
                break
            t = inflight.popleft().result()
            buffered.append(t)
            buffered_rows += len(t)
            if sort is None or buffered_rows >= reduce_at:
                fold()
    fold()
    if acc is None:
        acc = layout.with_partition_columns(layout.schema(table).empty_table(), "", "", read_cols)
    if sort is None and len(acc) > limit:
        truncated = True
        acc = acc.slice(0, limit)
    if columns:
        acc = acc.select(list(columns))
    return ScanResult(acc, len(files), opened, rows_opened, truncated)


def batches(
    blobs: BlobStore,
    files: Sequence[PlannedFile],
    table: str,
    filters: Filters,
    columns: Sequence[str],
    limit: int | None = None,
) -> Iterator[Any]:
    """Every matching row, as one pyarrow Table per file (in plan order), reading a few
    files ahead: a streamed answer of any size in bounded memory."""
    left = limit
    for t in _bounded_map(lambda f: read_file(blobs, f, table, filters, columns), files, 4):
        if left is not None:
            t = t.slice(0, left)
            left -= len(t)
        if len(t):
            yield t
        if left is not None and left <= 0:
            return
