"""One run's full detail, read fast: a compacted columnar copy in the blob store.

The raw batches stay the source of truth. The first read of a run that is no longer
running decodes its batches (named by ``run_batches``) once and writes three Parquet
files next to them under ``compact/``: tasks (one row per task, startstops flattened to
per-action seconds plus the raw list as JSON), graph (key, dependencies) and metrics
(worker, time, name, value). Every later read, in any process, reads Parquet instead of
decoding JSON. The file names carry the run's batch count and highest batch id, so a
batch indexed after compaction (a late retry) makes the next read build a fresh copy.
Running runs are read from the raw batches and not compacted.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import msgspec
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from hindsight.schema import GraphEvent, MetricEvent, StartStop, TaskEvent
from storage.analysis.rundata import RunData
from storage.analysis.runfacts import ACTION_COLUMNS, phases_of
from storage.core import manifest
from storage.core import models as m
from storage.core.batches import DEFAULT_RUN, decode_stored
from storage.core.blobs import BlobStore, LocalBlobStore, put_file
from storage.runs import packed
from storage.runs.context import FinishedRun, ReadOnce

logger = logging.getLogger(__name__)

# Metric batches are not tied to a run: take the session's batches received within this
# many seconds of the run's own, then keep samples inside the run's time window.
METRIC_SLACK_S = 60.0
#: A run's metrics: the samples within this many seconds of it (and each series' nearest
#: sample either side when it has none there).
METRIC_NEAR_S = 1.0
ROW_GROUP = 65_536
#: Task rows decoded into Python lists before they become one Arrow record batch.
BUILD_CHUNK = 50_000
_CACHE_SIZE = 4

TASK_COLUMNS = (
    "key",
    "prefix",
    "group",
    "worker",
    "thread",
    "status",
    "nbytes",
    "typename",
    "exception",
    "traceback",
    "start",
    "stop",
    "compute_start",
    "compute_stop",
    "compute",
    "transfer",
    "disk_read",
    "disk_write",
    "startstops",
    "attrs",
)


class RecentCache:
    """The few most recently used values of a process (thread-safe): a run's tables are
    read by several requests of one page view."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_cache = RecentCache(_CACHE_SIZE)


def _schemas() -> tuple[Any, Any, Any]:
    import pyarrow as pa

    s, f, i = pa.string(), pa.float64(), pa.int64()
    tasks = pa.schema(
        [
            ("key", s),
            ("prefix", s),
            ("group", s),
            ("worker", s),
            ("thread", i),
            ("status", s),
            ("nbytes", i),
            ("typename", s),
            ("exception", s),
            ("traceback", s),
            ("start", f),
            ("stop", f),
            ("compute_start", f),
            ("compute_stop", f),
            ("compute", f),
            ("transfer", f),
            ("disk_read", f),
            ("disk_write", f),
            ("startstops", s),
            ("attrs", s),
        ]
    )
    graph = pa.schema(
        [("key", s), ("prefix", s), ("dependencies", pa.list_(s)), ("submitted", pa.list_(f))]
    )
    metrics = pa.schema([("worker", s), ("time", f), ("name", s), ("value", f)])
    return tasks, graph, metrics


def run_tag(db: Session, run: m.Run) -> str:
    """The version of a run's stored data: its batch count and highest batch id."""
    n, hi = packed.batch_tag(db, run.id)
    return f"{n}-{hi}"


def _tag_order(tag: str) -> tuple[int, int] | None:
    n, _, hi = tag.partition("-")
    return (int(n), int(hi)) if n.isdigit() and hi.isdigit() else None


def prune_tags(blobs: BlobStore, base: str, current: str) -> int:
    """Delete the files of the versions under ``base`` that ``current`` (a ``run_tag``)
    supersedes: fewer batches, or as many under other ids (a rebuilt index renumbers
    them). A version with more batches is another process's newer one, and stays.
    Without this every new version (a late batch, every rebuild) left a full copy behind.
    Returns how many files went."""
    cur = _tag_order(current)
    if cur is None:
        return 0
    gone = 0
    for key in list(blobs.list(f"{base}/")):
        tag = key[len(base) + 1 :].partition("/")[0]
        order = _tag_order(tag)
        if order is not None and tag != current and order[0] <= cur[0]:
            blobs.delete(key)
            gone += 1
    return gone


def compact_prefix(db: Session, run: m.Run) -> str:
    tenant, cluster, session = db.execute(
        select(m.Tenant.name, m.Cluster.name, m.Session.name)
        .join(m.Cluster, m.Cluster.tenant_id == m.Tenant.id)
        .join(m.Session, m.Session.cluster_id == m.Cluster.id)
        .where(m.Session.id == run.session_id)
    ).one()
    return f"compact/v1/{tenant}/{cluster}/{session}/{run.public_id}"


def session_batches_around(
    db: Session, run: m.Run, slack: float, agents: Any = None
) -> list[tuple[int, str]]:
    """(id, blob key) of the session's batches holding events within ``slack`` seconds of
    the run, by event time (``batches.t_min``/``t_max``), so a reindex, which receives
    everything again, finds the same batches. Batches indexed before event times were
    recorded are taken by arrival time. ``agents``: a filter on ``Agent`` (e.g. workers)."""
    times = [t for t in (run.started_at, run.task_start) if t is not None]
    lo = min(times) - slack if times else None
    ends = [t for t in (run.finished_at, run.task_stop) if t is not None]
    hi = max(ends) + slack if ends and run.status != "running" else None
    B, C = m.Batch, m.ManifestChunk
    by_time = B.t_min.is_not(None)
    if lo is not None:
        by_time &= B.t_max >= lo
    if hi is not None:
        by_time &= B.t_min <= hi
    first, last = run.first_seen - slack, run.last_seen + slack
    by_arrival = B.t_min.is_(None) & B.received_at.between(first, last)
    where = [m.Agent.session_id == run.session_id]
    if agents is not None:
        where.append(agents)
    found = packed.keyed(db, *where, or_(by_time, by_arrival))
    # the collapsed batches: chunks the window reaches, then each of their batches
    reach = C.t_min.is_not(None)
    if lo is not None:
        reach &= C.t_max >= lo
    if hi is not None:
        reach &= C.t_min <= hi
    for e in manifest.collapsed(
        db, *where, or_(reach, and_(C.received_hi >= first, C.received_lo <= last))
    ):
        if e.t_min is None:
            taken = first <= e.received_at <= last
        else:
            late = e.t_max is not None and (lo is None or e.t_max >= lo)
            taken = late and (hi is None or e.t_min <= hi)
        if taken:
            found.append((e.id, e.key))
    return sorted(found)


def batch_keys(db: Session, run: m.Run) -> list[tuple[int, str, bool]]:
    """The batches that hold the run's records (``True``) and the session's other batches
    received around the run (``False``: metrics and worker-side events carry no run), as
    (batch id, blob key, the run's own), in batch order."""
    rows = packed.batch_keys(db, run.session_id, [b for b, _ in packed.run_batches(db, run.id)])
    run_ids = {i for i, _ in rows}
    others = session_batches_around(db, run, METRIC_SLACK_S)
    return sorted(
        [(i, k, True) for i, k in rows] + [(i, k, False) for i, k in others if i not in run_ids]
    )


def _build(db: Session, blobs: BlobStore, run: m.Run, sink: Any = None) -> tuple[Any, Any, Any]:
    """Decode the run's raw batches into Arrow tables. ``sink``: a Parquet writer the tasks
    are written to a chunk at a time instead (the tasks returned are then None): a run's
    task rows are never all held, whatever its size."""
    import pyarrow as pa

    tasks_schema, graph_schema, metrics_schema = _schemas()
    # the tasks' columns as Arrow arrays a chunk of rows at a time: Python lists of every
    # column of a 10^6-task run held ~1 GB (a str or float object per cell)
    cols: dict[str, list[Any]] = {c: [] for c in TASK_COLUMNS}
    chunks: list[Any] = []
    g_key: list[str] = []
    g_prefix: list[str] = []
    g_deps: list[list[str]] = []
    g_time: list[list[float]] = []
    g_row: dict[str, int] = {}
    metrics: list[tuple[str, float, dict[str, float]]] = []
    run_key = run.run_key
    for _, key, mine in batch_keys(db, run):
        batch = decode_stored(blobs.get(key))
        tasks: list[TaskEvent] = []
        for ev in batch.events:
            t = type(ev)
            if t is TaskEvent and mine and (ev.run or DEFAULT_RUN) == run_key:
                tasks.append(ev)
            elif t is GraphEvent and mine and (ev.run or DEFAULT_RUN) == run_key:
                row = g_row.get(ev.key)
                if row is not None:  # a later submission that touched it sent it again
                    if ev.time is not None:
                        g_time[row].append(ev.time)
                    continue
                g_row[ev.key] = len(g_key)
                g_key.append(ev.key)
                g_prefix.append(ev.prefix)
                g_deps.append(list(ev.dependencies))
                g_time.append([ev.time] if ev.time is not None else [])
            elif t is MetricEvent:
                metrics.append((ev.worker, ev.time, ev.values))
        if tasks:
            _task_columns(tasks, cols)
            if len(cols["key"]) >= BUILD_CHUNK:
                chunk = pa.record_batch(cols, schema=tasks_schema)
                if sink is None:
                    chunks.append(chunk)
                else:
                    sink.write_batch(chunk)
                cols = {c: [] for c in TASK_COLUMNS}
                del chunk
    chunk = pa.record_batch(cols, schema=tasks_schema)
    del cols
    if sink is None:
        tasks = pa.Table.from_batches([*chunks, chunk], schema=tasks_schema)
    else:
        if chunk.num_rows:
            sink.write_batch(chunk)
        tasks = None
    del chunks, chunk
    graph = pa.table(
        {"key": g_key, "prefix": g_prefix, "dependencies": g_deps, "submitted": g_time},
        schema=graph_schema,
    )
    lo = run.started_at if run.started_at is not None else run.task_start
    hi = run.finished_at if run.finished_at is not None else run.task_stop
    if run.task_stop is not None and (hi is None or run.task_stop > hi):
        hi = run.task_stop
    mw: list[str] = []
    mt: list[float] = []
    mn: list[str] = []
    mv: list[float] = []
    # Samples within a second of the run, and each series' nearest sample either side when
    # it has none there and was sampled across that edge of the run (not a worker that left
    # before it or joined after): samples come a second apart when on time, and a loaded
    # scheduler's are late, so a run shorter than that could have none within the second
    # (its page then drew no memory or CPU lines).
    before: dict[tuple[str, str], tuple[float, float]] = {}
    after: dict[tuple[str, str], tuple[float, float]] = {}
    near_lo: set[tuple[str, str]] = set()  # a sample within the second before the start
    near_hi: set[tuple[str, str]] = set()
    from_lo: set[str] = set()  # workers sampled at or after the start
    to_hi: set[str] = set()
    for worker, t, values in metrics:
        if lo is None or t >= lo:
            from_lo.add(worker)
        if hi is None or t <= hi:
            to_hi.add(worker)
        if lo is not None and t < lo - METRIC_NEAR_S:
            for name, v in values.items():
                if (worker, name) not in before or t > before[worker, name][0]:
                    before[worker, name] = (t, float(v))
        elif hi is not None and t > hi + METRIC_NEAR_S:
            for name, v in values.items():
                if (worker, name) not in after or t < after[worker, name][0]:
                    after[worker, name] = (t, float(v))
        else:
            n = len(values)
            mw.extend([worker] * n)
            mt.extend([t] * n)
            mn.extend(values)
            mv.extend(float(v) for v in values.values())
            if lo is not None and t <= lo:
                near_lo.update((worker, name) for name in values)
            if hi is not None and t >= hi:
                near_hi.update((worker, name) for name in values)
    for side, near, across in ((before, near_lo, from_lo), (after, near_hi, to_hi)):
        for (worker, name), (t, v) in side.items():
            if (worker, name) not in near and worker in across:
                mw.append(worker)
                mt.append(t)
                mn.append(name)
                mv.append(v)
    metrics_t = pa.table({"worker": mw, "time": mt, "name": mn, "value": mv}, schema=metrics_schema)
    return tasks, graph, metrics_t


def sample_run(*, through_parquet: bool = False) -> RunData:
    """A tiny finished run's tables (three tasks, one of them with a transfer, a graph and
    two samples of each worker metric the page plots), optionally written and read back
    as Parquet: what the dashboard builds once at start-up to warm its caches."""
    import pyarrow as pa

    tasks_schema, graph_schema, metrics_schema = _schemas()
    t0 = 1.0e9
    events = [
        TaskEvent(
            key=f"warm-{i}",
            prefix="warm",
            status="erred" if i == 2 else "memory",
            worker="tcp://127.0.0.1:1",
            thread=i,
            nbytes=8,
            startstops=[StartStop("transfer", t0, t0 + 0.1)] * (i == 1)
            + [StartStop("compute", t0 + i, t0 + i + 0.5)],
        )
        for i in range(3)
    ]
    cols: dict[str, list[Any]] = {c: [] for c in TASK_COLUMNS}
    _task_columns(events, cols)
    graph = pa.table(
        {
            "key": ["warm-0", "warm-1", "warm-2"],
            "prefix": ["warm"] * 3,
            "dependencies": [[], ["warm-0"], ["warm-1"]],
            "submitted": [[t0]] * 3,
        },
        schema=graph_schema,
    )
    names = ("memory.managed", "memory.unmanaged", "memory.spilled", "cpu", "tasks.processing")
    metrics = pa.table(
        {
            "worker": ["tcp://127.0.0.1:1"] * 10,
            "time": [t0, t0 + 1] * 5,
            "name": [n for n in names for _ in range(2)],
            "value": [1.0, 2.0] * 5,
        },
        schema=metrics_schema,
    )
    tables = [pa.table(cols, schema=tasks_schema), graph, metrics]
    if through_parquet:  # as a compacted copy is read (pyarrow's reader and its threads warm)
        import pyarrow.parquet as pq

        tables = [pq.read_table(io.BytesIO(_parquet(t))) for t in tables]
    return RunData(*tables, tag="warm", source="compact" if through_parquet else "raw")


def _task_columns(tasks: list[TaskEvent], cols: dict[str, list[Any]]) -> None:
    """Append a batch's tasks of the run to the task columns."""
    for name in (
        "key",
        "prefix",
        "group",
        "worker",
        "thread",
        "status",
        "nbytes",
        "typename",
        "exception",
        "traceback",
    ):
        cols[name].extend([getattr(e, name) for e in tasks])
    ph = phases_of(tasks)
    for name, values in (
        ("start", ph.start),
        ("stop", ph.stop),
        ("compute_start", ph.compute_start),
        ("compute_stop", ph.compute_stop),
    ):
        cols[name].extend(None if v != v else v for v in values.tolist())  # NaN -> null
    for i, name in enumerate(ACTION_COLUMNS[:4]):
        cols[name].extend(ph.seconds[:, i].tolist())
    enc = _encode
    cols["startstops"].extend([enc(e.startstops).decode() for e in tasks])
    # a scheduler's own facts about a task (e.g. Ray's attempt), as JSON
    cols["attrs"].extend([enc(e.attrs).decode() if e.attrs else None for e in tasks])


_encode = msgspec.json.Encoder().encode


def _parquet(table: Any) -> bytes:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=ROW_GROUP)
    return buf.getvalue()


def _local(blobs: Any) -> LocalBlobStore | None:
    """The local store under ``blobs`` (a finisher's :class:`ReadOnce` too), whose files
    are read in place: a column or a footer without fetching the whole file."""
    if isinstance(blobs, ReadOnce):
        blobs = blobs.blobs
    return blobs if isinstance(blobs, LocalBlobStore) else None


class CompactRun(RunData):
    """A compacted run whose tables are each read from its copy when first used: a big
    finished run's page draws from stored facts, rollups and tiles, and decoding its tasks
    table (~1 s and ~1 GB at 10^6 tasks) for a page that shows none of its rows was most of
    the page's first byte."""

    def __init__(self, blobs: BlobStore, base: str, tag: str) -> None:
        self._blobs, self._base = blobs, base
        self.tag, self.source, self.derived = tag, "compact", {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # called only for an attribute not set yet: a table not read yet
        if name not in ("tasks", "graph", "metrics"):
            raise AttributeError(name)
        import pyarrow.parquet as pq

        with self._lock:
            if name not in self.__dict__:
                key = f"{self._base}/{name}.parquet"
                local = _local(self._blobs)
                self.__dict__[name] = pq.read_table(
                    local.path(key) if local is not None else io.BytesIO(self._blobs.get(key))
                )
        return self.__dict__[name]

    def columns(self, name: str, columns: list[str]) -> Any:
        """Some columns of a table: of the table when it is read already, else read from
        the copy alone and not kept (a finisher reads what it needs and lets it go)."""
        import pyarrow.parquet as pq

        if name in self.__dict__:
            return self.__dict__[name].select(columns)
        key = f"{self._base}/{name}.parquet"
        local = _local(self._blobs)
        if local is not None:
            return pq.read_table(local.path(key), columns=columns)
        return pq.read_table(io.BytesIO(self._blobs.get(key)), columns=columns)

    def parts(self, name: str, columns: list[str], rows: int = ROW_GROUP) -> Iterator[Any]:
        """Some columns a row group at a time, read from the copy when the table is not read
        yet: one row group's columns are held, whatever the run's size."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if name in self.__dict__:
            yield from super().parts(name, columns, rows)
            return
        key = f"{self._base}/{name}.parquet"
        local = _local(self._blobs)
        with pq.ParquetFile(
            local.path(key) if local is not None else io.BytesIO(self._blobs.get(key))
        ) as f:
            for i in range(f.metadata.num_row_groups):
                table = f.read_row_group(i, columns=columns)
                for lo in range(0, table.num_rows, rows):
                    yield table.slice(lo, rows)
                del table
            if not f.metadata.num_row_groups:
                yield pa.schema([f.schema_arrow.field(c) for c in columns]).empty_table()

    def take(self, name: str, rows: list[int], columns: list[str]) -> Any:
        """Rows of some columns, from the row groups that hold them alone when the table is
        not read yet (the critical path's few records of a large run)."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        if name in self.__dict__ or not rows:
            return super().take(name, rows, columns)
        key = f"{self._base}/{name}.parquet"
        local = _local(self._blobs)
        with pq.ParquetFile(
            local.path(key) if local is not None else io.BytesIO(self._blobs.get(key))
        ) as f:
            meta = f.metadata
            sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            firsts = np.concatenate([[0], np.cumsum(sizes)])
            want = np.asarray(rows, dtype=np.int64)
            groups = np.unique(np.searchsorted(firsts, want, side="right") - 1).tolist()
            table = f.read_row_groups(groups, columns=columns)
        # positions within the groups read: each row less the rows of the groups skipped
        read_firsts = firsts[groups]
        offset = np.concatenate([[0], np.cumsum([sizes[g] for g in groups])])[:-1]
        at = np.searchsorted(read_firsts, want, side="right") - 1
        return table.take(pa.array(want - read_firsts[at] + offset[at]))

    def rows(self, name: str) -> int:
        """A table's row count, from its Parquet footer when the table is not read yet: on
        a local store the footer alone is read (the whole file was fetched for it, ~0.1 s
        of a 10^6-task run's page and its tasks table's size in memory)."""
        import pyarrow.parquet as pq

        if name in self.__dict__:
            return int(self.__dict__[name].num_rows)
        key = f"{self._base}/{name}.parquet"
        local = _local(self._blobs)
        if local is not None:
            with pq.ParquetFile(local.path(key)) as f:
                return int(f.metadata.num_rows)
        return int(pq.ParquetFile(io.BytesIO(self._blobs.get(key))).metadata.num_rows)


def table_rows(data: RunData, name: str) -> int:
    """The row count of one of ``data``'s tables, without reading a table not read yet."""
    if isinstance(data, CompactRun):
        return data.rows(name)
    return int(getattr(data, name).num_rows)


def load_run(
    db: Session,
    blobs: BlobStore,
    run: m.Run,
    *,
    write: bool = True,
    cache: bool = True,
    lazy: bool = False,
) -> RunData:
    """The run's tasks, graph and metrics: from the process cache, the compacted copy, or
    the raw batches (then compacted, if the run has ended and ``write``). ``cache``: keep
    the tables in this process's cache of recent runs. ``lazy``: a compacted run's tables
    are read when first used (:class:`CompactRun`)."""
    import pyarrow.parquet as pq

    tag = run_tag(db, run)
    base = compact_prefix(db, run)
    cache_key = f"{base}/{tag}"
    hit = _cache.get(cache_key)
    if hit is not None:
        return hit
    names = ("tasks", "graph", "metrics")
    try:
        if lazy and blobs.exists(f"{cache_key}/tasks.parquet"):
            data = CompactRun(blobs, cache_key, tag)
        else:
            tables = [
                pq.read_table(io.BytesIO(blobs.get(f"{cache_key}/{n}.parquet"))) for n in names
            ]
            data = RunData(*tables, tag=tag, source="compact")
    except FileNotFoundError:
        if write and run.status != "running":
            rows = _compact(db, blobs, run, cache_key)
            logger.info("compacted run %s (%d tasks) at %s", run.public_id, rows, cache_key)
            prune_tags(blobs, base, tag)
            # read back what is used from the copy, not every table built
            data = CompactRun(blobs, cache_key, tag)
            if not lazy:
                data = RunData(data.tasks, data.graph, data.metrics, tag=tag, source="compact")
        else:
            tasks, graph, metrics = _build(db, blobs, run)
            data = RunData(tasks, graph, metrics, tag=tag, source="raw")
    if cache and (data.source == "compact" or run.status != "running"):
        _cache.put(cache_key, data)
    return data


def _compact(db: Session, blobs: BlobStore, run: m.Run, at: str) -> int:
    """Write the run's compacted copy under ``at``; returns its task count. The tasks are
    streamed to a spooled file a chunk at a time (a 10^7-task run's rows are gigabytes as
    Arrow tables); metrics and graph first, tasks last: tasks.parquet present means
    complete."""
    import pyarrow.parquet as pq

    tasks_schema = _schemas()[0]
    with tempfile.TemporaryDirectory(prefix="hindsight-compact-") as tmp:
        path = os.path.join(tmp, "tasks.parquet")
        with pq.ParquetWriter(path, tasks_schema, compression="zstd") as sink:
            _, graph, metrics = _build(db, blobs, run, sink)
        for n, table in (("graph", graph), ("metrics", metrics)):
            blobs.put(f"{at}/{n}.parquet", _parquet(table), if_absent=True)
        del graph, metrics
        put_file(blobs, f"{at}/tasks.parquet", path, if_absent=True)
        with pq.ParquetFile(path) as f:
            return int(f.metadata.num_rows)


def finish(fr: FinishedRun) -> None:
    """Finisher: write the compacted copy when the run finishes, so no view waits for it,
    and count the run's graph tasks once each: the index adds up graph events, and Dask's
    agent sends one for every task a submission touched, those of earlier submissions too
    (a ``client.submit(total, *futures)`` counted the futures twice)."""
    import pyarrow.compute as pc

    graph = fr.data().graph
    if graph.num_rows:  # (a run without graph events keeps its count)
        fr.run.graph_count = pc.count_distinct(graph["key"]).as_py()


def compacted_tasks_key(db: Session, blobs: BlobStore, run: m.Run) -> str | None:
    """The blob key of the run's compacted tasks file (compacting it now if needed), or
    None for a running run."""
    if run.status == "running":
        return None
    key = f"{compact_prefix(db, run)}/{run_tag(db, run)}/tasks.parquet"
    if not blobs.exists(key):
        load_run(db, blobs, run)
    return key


def clear_cache() -> None:
    """Forget the in-process copies (benchmarks measure cold reads)."""
    _cache.clear()


def task_slice(
    db: Session, blobs: BlobStore, run: m.Run, offset: int, limit: int
) -> tuple[Any, int]:
    """Rows ``[offset, offset+limit)`` of the run's tasks (stored order) and the total.

    A page of a large run should not decode the whole run: from the compacted copy only
    the row groups that hold the page are decoded. Falls back to :func:`load_run`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tag = run_tag(db, run)
    cache_key = f"{compact_prefix(db, run)}/{tag}"
    hit = _cache.get(cache_key)
    if hit is None and run.status != "running":
        try:
            body = blobs.get(f"{cache_key}/tasks.parquet")
        except FileNotFoundError:
            body = None
        if body is not None:
            f = pq.ParquetFile(io.BytesIO(body))
            total = f.metadata.num_rows
            groups, first, row = [], None, 0
            for i in range(f.metadata.num_row_groups):
                n = f.metadata.row_group(i).num_rows
                if row + n > offset and row < offset + limit:
                    groups.append(i)
                    if first is None:
                        first = row
                row += n
            if not groups:
                return _schemas()[0].empty_table(), total
            table = f.read_row_groups(groups)
            return table.slice(offset - (first or 0), limit), total
    data = hit or load_run(db, blobs, run)
    t: pa.Table = data.tasks
    return t.slice(offset, limit), len(t)
