"""Scans of the history lake for the query service.

A scan is planned by the lake's Iceberg table (``storage/lake/write.py``): the tenant's
partitions, pruned by partition (clusters, days up to ``until``) and by each data file's
column bounds against the filters (time window, run, prefix, status, durations...), then
by the statistics in each file's footer (which prefixes, statuses, metric and stream
names it holds, and per prefix its longest duration and largest result; read once per
file and cached, files never change). The files left are read in parallel from the blob
store with the row filter pushed into the Parquet reader (row groups whose statistics
cannot match are skipped). A descending sort reads files in the order of their bounds
(per prefix for duration and bytes) and stops as soon as no unread file can hold a row of
the answer: "the 100 slowest tasks of a prefix
over 30 days" opens a handful of files, not all.

A plan is of one snapshot; a file it names stays for ``write.RETAIN_S`` after a newer
snapshot dropped it. If one is gone all the same, the route plans again and restarts once.
"""

from __future__ import annotations

import io
import json
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hindsight import lake as layout
from hindsight.lake import Filters
from storage.core.blobs import BlobStore, LocalBlobStore
from storage.lake import write
from storage.lake.write import Location

logger = logging.getLogger(__name__)

#: Sorts the footer statistics bound per prefix (column -> index in stats["prefixes"]).
_PREFIX_BOUNDS = {("tasks", "duration"): 1, ("tasks", "nbytes"): 2}

IO_THREADS = 8
#: The sorts a data file's upper bound on the column bounds (descending: stop early).
_BOUNDED_SORTS = {
    ("tasks", "duration"),
    ("tasks", "nbytes"),
    ("tasks", "start"),
    ("tasks", "stop"),
    ("metrics", "value"),
    ("metrics", "time"),
    ("runs", "makespan"),
    ("runs", "started_at"),
    ("streams", "time"),
}


@dataclass
class PlannedFile:
    """A data file a scan reads, with its partition."""

    cluster: str
    day: str
    key: str  # relative to the blob store's root
    rows: int
    bytes: int
    upper: dict[str, float] = field(default_factory=dict)  # bounded sort columns' bounds
    stats: dict[str, Any] | None = None  # the file's footer statistics (write._stats)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[1]


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


def plan(loc: Location, tenant: str, table: str, filters: Filters) -> list[PlannedFile]:
    """The data files of the tenant's ``table`` that ``filters`` may match (partition and
    column-bound pruning by the Iceberg planner, then per prefix, status, metric and stream
    by each file's footer statistics), in partition order."""
    from pyiceberg.conversions import from_bytes

    filters.check(table)
    tbl = write.table(loc, table)
    schema = tbl.schema()
    bounded = {
        schema.find_field(c).field_id: (c, schema.find_field(c).field_type)
        for t, c in _BOUNDED_SORTS
        if t == table
    }
    out = []
    for f in data_files(tbl, filters.iceberg(table, tenant)):
        upper = {}
        for fid, raw in (f.upper_bounds or {}).items():
            if fid in bounded:
                col, kind = bounded[fid]
                upper[col] = float(from_bytes(kind, raw))
        out.append(
            PlannedFile(
                f.partition[1],
                f.partition[2],
                loc.key(f.file_path),
                f.record_count,
                f.file_size_in_bytes,
                upper,
            )
        )
    if table != "runs" and out:
        paths = [f"{loc.blob_url.rstrip('/')}/{p.key}" for p in out]
        for p, stats in zip(
            out, _bounded_map(lambda x: footer_stats(tbl.io, x), paths, 8), strict=True
        ):
            p.stats = stats
        out = [p for p in out if may_match(table, filters, p.stats)]
    out.sort(key=lambda p: (p.day, p.cluster, p.key))
    return out


#: Live data files of each manifest, by its location (manifests never change: decoding
#: them is most of planning a large table, so it is done once per manifest and process).
_ENTRIES: dict[str, list[Any]] = {}
_ENTRIES_MAX = 2_000


def data_files(tbl: Any, row_filter: Any) -> list[Any]:
    """The data files of ``tbl``'s current snapshot that ``row_filter`` may match: what
    pyiceberg's ``scan(row_filter).plan_files()`` plans (manifest, partition and column-
    bound pruning, with its own evaluators), from manifests decoded once. The lake writes no
    delete files; a table with some is planned by pyiceberg itself."""
    from pyiceberg.expressions.visitors import (
        _InclusiveMetricsEvaluator,
        expression_evaluator,
        manifest_evaluator,
    )
    from pyiceberg.manifest import ManifestContent
    from pyiceberg.schema import Schema

    scan = tbl.scan(row_filter=row_filter)
    snapshot = scan.snapshot()
    if snapshot is None:
        return []
    manifests = snapshot.manifests(tbl.io)
    if any(mf.content != ManifestContent.DATA for mf in manifests):
        return [t.file for t in scan.plan_files()]
    schema, specs = tbl.schema(), tbl.metadata.specs()
    metrics = _InclusiveMetricsEvaluator(schema, scan.row_filter, True, False).eval
    evaluators: dict[int, tuple[Any, Any]] = {}
    out = []
    for mf in manifests:
        sid = mf.partition_spec_id
        if sid not in evaluators:
            spec, pfilter = specs[sid], scan.partition_filters[sid]
            pschema = Schema(*spec.partition_type(schema).fields)
            evaluators[sid] = (
                manifest_evaluator(spec, schema, pfilter, True),
                expression_evaluator(pschema, pfilter, True),
            )
        keep_manifest, keep_partition = evaluators[sid]
        if not keep_manifest(mf):
            continue
        entries = _ENTRIES.get(mf.manifest_path)
        if entries is None:
            entries = [e.data_file for e in mf.fetch_manifest_entry(tbl.io, discard_deleted=True)]
            if len(_ENTRIES) >= _ENTRIES_MAX:
                _ENTRIES.clear()
            _ENTRIES[mf.manifest_path] = entries
        out += [f for f in entries if keep_partition(f.partition) and metrics(f)]
    return out


#: Footer statistics by file location (files never change; a bounded cache).
_STATS: dict[str, dict[str, Any] | None] = {}
_STATS_MAX = 200_000


def footer_stats(io: Any, path: str) -> dict[str, Any] | None:
    """A data file's statistics from its Parquet footer."""
    import pyarrow.parquet as pq

    if path in _STATS:
        return _STATS[path]
    try:
        with io.new_input(path).open() as fh:
            kv = pq.read_metadata(fh).metadata or {}
    except (FileNotFoundError, OSError, ValueError):
        return None  # unknown: the file is kept, its read says what went wrong
    raw = kv.get(write.STATS_KEY)
    stats = None if raw is None else json.loads(raw)
    if len(_STATS) >= _STATS_MAX:
        _STATS.clear()
    _STATS[path] = stats
    return stats


def may_match(table: str, f: Filters, stats: dict[str, Any] | None) -> bool:
    """Whether a file's footer statistics leave any chance of a matching row."""
    if not stats:
        return True
    if table == "tasks":
        prefixes = stats.get("prefixes")
        if prefixes is not None:
            wanted = (
                [prefixes[p] for p in f.prefix if p in prefixes]
                if f.prefix
                else list(prefixes.values())
            )
            if not wanted:
                return False
            if f.min_duration is not None and max(w[1] for w in wanted) < f.min_duration:
                return False
            if f.min_nbytes is not None and max(w[2] for w in wanted) < f.min_nbytes:
                return False
        statuses = stats.get("statuses")
        if f.status and statuses is not None and not set(f.status) & set(statuses):
            return False
    for name, stat in (("name", "names"), ("stream", "streams")):
        wanted_names = getattr(f, name)
        present = stats.get(stat)
        if wanted_names and present is not None and not set(wanted_names) & set(present):
            return False
    return True


def _bound(f: PlannedFile, sort: Sort, table: str, filters: Filters) -> float | None:
    """The largest value of the sort column any matching row of ``f`` can hold (None:
    unknown): per prefix from the footer statistics where they say, else the file's
    Iceberg upper bound."""
    index = _PREFIX_BOUNDS.get((table, sort.column))
    prefixes = (f.stats or {}).get("prefixes")
    if index is not None and prefixes is not None:
        wanted = (
            [prefixes[p] for p in filters.prefix if p in prefixes]
            if filters.prefix
            else prefixes.values()
        )
        return max((w[index] for w in wanted), default=float("-inf"))
    return f.upper.get(sort.column)


def read_file(
    blobs: BlobStore, f: PlannedFile, table: str, filters: Filters, columns: Sequence[str]
) -> Any:
    """One file's rows matching ``filters``: its ``columns`` (all but ``tenant`` if empty)."""
    import pyarrow.parquet as pq

    # A local file is read in place (only the column chunks asked for; memory-mapping such
    # small files measured slower), from S3 whole.
    source = blobs.path(f.key) if isinstance(blobs, LocalBlobStore) else None
    names = layout.answer_columns(table, columns)
    t = pq.read_table(
        str(source) if source is not None else io.BytesIO(blobs.get(f.key)),
        columns=names,
        filters=filters.expression(table),
    )
    return layout.conform(t, table, names)


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
                rows_opened += f.rows
            if not inflight:
                break
            t = inflight.popleft().result()
            buffered.append(t)
            buffered_rows += len(t)
            if sort is None or buffered_rows >= reduce_at:
                fold()
    fold()
    if acc is None:
        full = layout.schema(table, with_partition=True).empty_table()
        acc = full.select(layout.answer_columns(table, read_cols))
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
