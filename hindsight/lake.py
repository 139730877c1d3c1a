"""The history lake: every task, metric sample, emitted value and run summary of every
finished run, as Hive-partitioned Parquet in the blob store (docs/lake.md).

This module is the one definition of the lake's layout, its manifests and its filters. The
server writes the lake (``storage/lake/build.py``) and answers ``/v1/lake/...`` with it; readers
use it here without a server: ``files()`` plans a scan from the manifests, ``dataset()``
gives a ``pyarrow.dataset`` and ``dataframe()`` a ``dask.dataframe`` (one partition per
file), straight from ``s3://bucket/prefix`` or a local directory.

Layout (``{root}`` is the blob store's root, e.g. ``s3://bucket/hindsight``)::

    {root}/lake/v1/{table}/tenant={tenant}/cluster={cluster}/day={YYYY-MM-DD}/part-{seq}-{hash}.parquet
    {root}/lake/v1/_manifests/tenant={tenant}/cluster={cluster}/day={YYYY-MM-DD}/{seq}.json

``day`` is the UTC date the run started: all rows of a run live in one partition per table.
A partition's manifest with the highest ``seq`` names its live files; files it lists under
``removed`` are kept for a grace period (readers holding an older manifest still find them)
and then deleted. Readers that plan from the manifests never count a run twice or miss one;
listing the Parquet files directly can see both a merged file and its inputs for that grace
period.

pyarrow, and dask for ``dataframe()``, are imported when first needed.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from datetime import UTC, date, datetime, timedelta
from typing import Any

import msgspec

LAKE_VERSION = 1
ROOT = f"lake/v{LAKE_VERSION}"
MANIFESTS = f"{ROOT}/_manifests"
TABLES = ("tasks", "metrics", "runs", "streams")
#: Hive partition columns, in path order; they are not stored inside the files.
PARTITION_COLUMNS = ("tenant", "cluster", "day")

_FILE_RE = re.compile(r"^part-\d{10}-[0-9a-f]{16}\.parquet$")
_DAY_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_MANIFEST_RE = re.compile(
    rf"^{MANIFESTS}/tenant=(?P<tenant>[^/]+)/cluster=(?P<cluster>[^/]+)/day=(?P<day>[^/]+)/(?P<seq>\d{{10}})\.json$"
)


# ---------------------------------------------------------------- layout


def day_of(t: float) -> str:
    """The UTC date of epoch seconds ``t``, as a partition value."""
    return datetime.fromtimestamp(t, UTC).date().isoformat()


def day_start(day: str) -> float:
    """Epoch seconds of 00:00 UTC on ``day``."""
    return datetime.combine(date.fromisoformat(day), datetime.min.time(), UTC).timestamp()


def next_day(day: str) -> str:
    return (date.fromisoformat(day) + timedelta(days=1)).isoformat()


def valid_day(day: str) -> bool:
    if not _DAY_RE.match(day):
        return False
    try:
        date.fromisoformat(day)
    except ValueError:
        return False
    return True


def valid_file_name(name: str) -> bool:
    return bool(_FILE_RE.match(name))


def partition_dir(table: str, tenant: str, cluster: str, day: str) -> str:
    return f"{ROOT}/{table}/tenant={tenant}/cluster={cluster}/day={day}"


def manifest_dir(tenant: str, cluster: str, day: str) -> str:
    return f"{MANIFESTS}/tenant={tenant}/cluster={cluster}/day={day}"


def manifest_key(tenant: str, cluster: str, day: str, seq: int) -> str:
    return f"{manifest_dir(tenant, cluster, day)}/{seq:010d}.json"


def parse_manifest_key(key: str) -> tuple[str, str, str, int] | None:
    """(tenant, cluster, day, seq) of a manifest key, or None."""
    m = _MANIFEST_RE.match(key)
    if m is None:
        return None
    return m["tenant"], m["cluster"], m["day"], int(m["seq"])


def latest_manifests(keys: Iterable[str]) -> dict[tuple[str, str, str], str]:
    """The newest manifest key of each (tenant, cluster, day) among ``keys``."""
    best: dict[tuple[str, str, str], tuple[int, str]] = {}
    for key in keys:
        parsed = parse_manifest_key(key)
        if parsed is None:
            continue
        part, seq = parsed[:3], parsed[3]
        if part not in best or seq > best[part][0]:
            best[part] = (seq, key)
    return {part: key for part, (_, key) in best.items()}


#: The columns of each table, in order (Arrow types by name). This is the lake's contract:
#: a column is never removed, renamed or retyped within a lake version; new columns may be
#: added at the end. tasks and metrics are the compacted run copy's columns
#: (``storage/runs/runfile.py``) after the run's identity, its ``compute`` named ``duration`` as
#: in a run's task records (and clear of Dask's ``DataFrame.compute``); a test keeps them
#: in step.
COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "tasks": (
        ("run", "string"),
        ("session", "string"),
        ("key", "string"),
        ("prefix", "string"),
        ("group", "string"),
        ("worker", "string"),
        ("thread", "int64"),
        ("status", "string"),
        ("nbytes", "int64"),
        ("typename", "string"),
        ("exception", "string"),
        ("traceback", "string"),
        ("start", "float64"),
        ("stop", "float64"),
        ("compute_start", "float64"),
        ("compute_stop", "float64"),
        ("duration", "float64"),
        ("transfer", "float64"),
        ("disk_read", "float64"),
        ("disk_write", "float64"),
        ("startstops", "string"),
        ("attrs", "string"),  # the scheduler's own facts (JSON), e.g. Ray's attempt (issue 12)
    ),
    "metrics": (
        ("run", "string"),
        ("session", "string"),
        ("worker", "string"),
        ("time", "float64"),
        ("name", "string"),
        ("value", "float64"),
    ),
    "runs": (
        ("run", "string"),
        ("session", "string"),
        ("name", "string"),
        ("run_key", "string"),
        ("status", "string"),
        ("started_at", "float64"),
        ("finished_at", "float64"),
        ("task_start", "float64"),
        ("task_stop", "float64"),
        ("makespan", "float64"),
        ("task_count", "int64"),
        ("error_count", "int64"),
        ("graph_count", "int64"),
        ("nbytes", "int64"),
        ("compute_seconds", "float64"),
        ("transfer_seconds", "float64"),
        ("disk_read_seconds", "float64"),
        ("disk_write_seconds", "float64"),
        ("workers", "int64"),
        ("prefixes", "list<string>"),
        ("fingerprint", "string"),
        ("span", "list<string>"),
        ("client", "string"),
    ),
    "streams": (
        ("run", "string"),
        ("session", "string"),
        ("stream", "string"),
        ("time", "float64"),
        ("worker", "string"),
        ("key", "string"),
        ("value", "string"),
        ("number", "float64"),
    ),
}


def schema(table: str, with_partition: bool = False) -> Any:
    """The Arrow schema of ``table`` (with the partition columns appended if asked)."""
    import pyarrow as pa

    types = {
        "string": pa.string(),
        "int64": pa.int64(),
        "float64": pa.float64(),
        "list<string>": pa.list_(pa.string()),
    }
    fields_ = [pa.field(n, types[t]) for n, t in COLUMNS[table]]
    if with_partition:
        fields_ += [pa.field(n, pa.string()) for n in PARTITION_COLUMNS]
    return pa.schema(fields_)


def columns_of(table: str) -> tuple[str, ...]:
    """Every column a scan of ``table`` can return: the stored ones, then cluster and day."""
    return (*(n for n, _ in COLUMNS[table]), "cluster", "day")


# ---------------------------------------------------------------- manifests


class FileEntry(msgspec.Struct):
    """One live Parquet file of a partition."""

    table: str
    key: str  # relative to the blob store's root
    rows: int
    bytes: int
    runs: list[str]  # public ids of the runs with rows in this file
    t_min: float | None = None  # earliest start/time of its rows (pruning)
    t_max: float | None = None  # latest stop/time of its rows
    # Per-file statistics for pruning; see docs/lake.md ("prefixes": {prefix: [rows,
    # max compute, max nbytes, erred]}, "statuses", "names", "streams", "max_compute", ...).
    stats: dict[str, Any] = {}


class RunEntry(msgspec.Struct):
    """A run present in a partition, at the version (``tag``) of its data written."""

    tag: str
    session: str


class Removed(msgspec.Struct):
    """A file superseded at ``at``; deleted once the grace period has passed."""

    key: str
    at: float


class Manifest(msgspec.Struct):
    """The state of one (tenant, cluster, day) partition at commit ``seq``."""

    format: str
    lake: int
    tenant: str
    cluster: str
    day: str
    seq: int
    committed_at: float
    runs: dict[str, RunEntry] = {}
    files: list[FileEntry] = []
    removed: list[Removed] = []


_manifest_decoder = msgspec.json.Decoder(Manifest)


def decode_manifest(data: bytes) -> Manifest:
    manifest = _manifest_decoder.decode(data)
    if manifest.format != "hindsight-lake" or manifest.lake != LAKE_VERSION:
        raise ValueError(f"not a lake v{LAKE_VERSION} manifest: {manifest.format} v{manifest.lake}")
    return manifest


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.json.encode(manifest)


def empty_manifest(tenant: str, cluster: str, day: str) -> Manifest:
    return Manifest("hindsight-lake", LAKE_VERSION, tenant, cluster, day, 0, 0.0)


# ---------------------------------------------------------------- filters

#: Per table: the columns a time window applies to (rows overlapping [since, until)).
TIME_COLUMNS = {
    "tasks": ("start", "stop"),
    "metrics": ("time", "time"),
    "streams": ("time", "time"),
    "runs": ("started_at", "started_at"),
}
_LIST_FILTERS = {
    # filter -> (column, tables it applies to)
    "run": ("run", TABLES),
    "session": ("session", TABLES),
    "prefix": ("prefix", ("tasks",)),
    "status": ("status", ("tasks", "runs")),
    "worker": ("worker", ("tasks", "metrics", "streams")),
    "name": ("name", ("metrics", "runs")),
    "stream": ("stream", ("streams",)),
    "key": ("key", ("tasks", "streams")),
}
_RANGE_FILTERS = {
    # filter -> (column, bound, tables)
    "min_duration": ("duration", ">=", ("tasks",)),
    "max_duration": ("duration", "<=", ("tasks",)),
    "min_nbytes": ("nbytes", ">=", ("tasks", "runs")),
    "max_nbytes": ("nbytes", "<=", ("tasks", "runs")),
    "min_value": ("value", ">=", ("metrics",)),
    "max_value": ("value", "<=", ("metrics",)),
    "min_makespan": ("makespan", ">=", ("runs",)),
}


@dataclass
class Filters:
    """What a lake scan keeps. Lists mean "any of"; unset means "no condition".

    ``since``/``until`` keep rows overlapping [since, until): tasks that stopped at or after
    ``since`` and started before ``until``; metric samples and emitted values by time; runs
    by start. ``min_duration``/``max_duration`` bound a task's compute seconds (its
    ``duration`` in a run's task records)."""

    cluster: list[str] = field(default_factory=list)
    since: float | None = None
    until: float | None = None
    run: list[str] = field(default_factory=list)
    session: list[str] = field(default_factory=list)
    prefix: list[str] = field(default_factory=list)
    status: list[str] = field(default_factory=list)
    worker: list[str] = field(default_factory=list)
    name: list[str] = field(default_factory=list)
    stream: list[str] = field(default_factory=list)
    key: list[str] = field(default_factory=list)
    min_duration: float | None = None
    max_duration: float | None = None
    min_nbytes: float | None = None
    max_nbytes: float | None = None
    min_value: float | None = None
    max_value: float | None = None
    min_makespan: float | None = None

    def check(self, table: str) -> None:
        """ValueError naming the first filter that does not apply to ``table``."""
        if table not in TABLES:
            raise ValueError(f"table: must be one of {', '.join(TABLES)}")
        for name, (_col, tables) in _LIST_FILTERS.items():
            if getattr(self, name) and table not in tables:
                raise ValueError(f"{name}: does not apply to the {table} table")
        for name, (_col, _op, tables) in _RANGE_FILTERS.items():
            if getattr(self, name) is not None and table not in tables:
                raise ValueError(f"{name}: does not apply to the {table} table")

    def params(self) -> dict[str, Any]:
        """As query parameters of ``/v1/lake/...`` (lists repeat the parameter)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value != []:
                out[f.name] = value
        return out

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> Filters:
        """Filters from keyword arguments: single values or lists; times as epoch seconds,
        ISO strings or datetimes."""
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown lake filter(s): {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        for name, value in kwargs.items():
            if value is None:
                continue
            if name in _LIST_FILTERS or name == "cluster":
                values[name] = [value] if isinstance(value, str) else [str(v) for v in value]
            elif name in ("since", "until"):
                values[name] = _epoch(value, day_end=name == "until")
            else:
                values[name] = float(value)
        return cls(**values)

    def expression(self, table: str) -> Any:
        """The row condition as a pyarrow expression (None: every row), without the
        partition columns (cluster), which planning has already applied."""
        import pyarrow.compute as pc

        conds = []
        lo_col, hi_col = TIME_COLUMNS[table]
        if self.since is not None:
            conds.append(pc.field(hi_col) >= self.since)
        if self.until is not None:
            conds.append(pc.field(lo_col) < self.until)
        for name, (col, _tables) in _LIST_FILTERS.items():
            values = getattr(self, name)
            if values:
                conds.append(
                    pc.field(col) == values[0] if len(values) == 1 else pc.field(col).isin(values)
                )
        for name, (col, op, _tables) in _RANGE_FILTERS.items():
            value = getattr(self, name)
            if value is not None:
                conds.append(pc.field(col) >= value if op == ">=" else pc.field(col) <= value)
        if not conds:
            return None
        out = conds[0]
        for c in conds[1:]:
            out = out & c
        return out

    def file_may_match(self, entry: FileEntry) -> bool:
        """Whether a file's statistics leave any chance of a matching row."""
        if self.since is not None and entry.t_max is not None and entry.t_max < self.since:
            return False
        if self.until is not None and entry.t_min is not None and entry.t_min >= self.until:
            return False
        if self.run and not set(self.run) & set(entry.runs):
            return False
        stats = entry.stats
        if entry.table == "tasks":
            prefixes = stats.get("prefixes")
            if prefixes is not None:
                wanted = (
                    [prefixes[p] for p in self.prefix if p in prefixes]
                    if self.prefix
                    else list(prefixes.values())
                )
                if not wanted:
                    return False
                if self.min_duration is not None and max(w[1] for w in wanted) < self.min_duration:
                    return False
                if self.min_nbytes is not None and max(w[2] for w in wanted) < self.min_nbytes:
                    return False
            statuses = stats.get("statuses")
            if self.status and statuses is not None and not set(self.status) & set(statuses):
                return False
        for name, stat in (("name", "names"), ("stream", "streams")):
            wanted_names = getattr(self, name)
            present = stats.get(stat)
            if wanted_names and present is not None and not set(wanted_names) & set(present):
                return False
        return True


def _epoch(value: Any, day_end: bool = False) -> float:
    """Epoch seconds of a time: a number, a datetime (naive: UTC), an ISO 8601 text, a
    pandas Timestamp. A day alone (a ``date``, ``"2026-11-21"``) is its midnight, UTC, or
    with ``day_end`` (an ``until``: bounds are exclusive) the next one, as the services
    read a day alone given as ``until``."""
    days = 1 if day_end else 0
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=UTC)
        return dt.timestamp()
    if isinstance(value, date):
        return datetime.combine(value, datetime.min.time(), UTC).timestamp() + days * 86400.0
    if hasattr(value, "timestamp"):  # pandas.Timestamp
        return float(value.timestamp())
    text = str(value).replace("Z", "+00:00")
    if len(text) == 8 and text.isdigit():
        # eight digits are a day, as the services read them (20261126 seconds is 1970)
        try:
            return _epoch(date.fromisoformat(text), day_end)
        except ValueError:
            pass
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return _epoch(date.fromisoformat(text), day_end)
    except ValueError:
        dt = datetime.fromisoformat(text)
        return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


# ---------------------------------------------------------------- direct reads


def filesystem(
    location: str, *, endpoint_url: str | None = None, region: str | None = None
) -> tuple[Any, str]:
    """(pyarrow filesystem, base path) for a blob store location: ``s3://bucket/prefix``,
    ``file:///path`` or a local path. S3 credentials come from the usual AWS variables,
    files or instance roles."""
    from pyarrow import fs as pafs

    parsed = urllib.parse.urlsplit(location)
    if parsed.scheme == "s3":
        kwargs: dict[str, Any] = {"region": region or "us-east-1"}
        if endpoint_url:
            ep = urllib.parse.urlsplit(endpoint_url)
            kwargs["endpoint_override"] = ep.netloc or ep.path
            kwargs["scheme"] = ep.scheme or "https"
        base = f"{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
        return pafs.S3FileSystem(**kwargs), base
    if parsed.scheme == "file":
        return pafs.LocalFileSystem(), urllib.parse.unquote(parsed.path).rstrip("/")
    if parsed.scheme:
        raise ValueError(f"unsupported lake location {location!r} (s3://, file:// or a path)")
    return pafs.LocalFileSystem(), location.rstrip("/")


@dataclass
class LakeFile:
    """One file a scan reads: where it is and what it holds."""

    table: str
    cluster: str
    day: str
    path: str  # for the filesystem it was planned with
    rows: int
    bytes: int
    runs: list[str]


def manifests(fs: Any, base: str, tenant: str, clusters: Sequence[str] = ()) -> list[Manifest]:
    """The newest manifest of every partition of ``tenant`` (of ``clusters`` if given)."""
    from pyarrow import fs as pafs

    roots = [f"{base}/{MANIFESTS}/tenant={tenant}"]
    if clusters:
        roots = [f"{roots[0]}/cluster={c}" for c in clusters]
    keys = []
    for root in roots:
        try:
            infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        except FileNotFoundError:
            continue
        keys += [i.path[len(base) + 1 :] for i in infos if i.type == pafs.FileType.File]
    latest = sorted(latest_manifests(keys).values())

    def read(key: str) -> Manifest | None:
        for _ in range(3):
            try:
                with fs.open_input_stream(f"{base}/{key}") as fh:
                    return decode_manifest(fh.read())
            except FileNotFoundError:  # superseded while listing: take the newer one
                parsed = parse_manifest_key(key)
                assert parsed is not None
                t, c, d, _ = parsed
                sel = pafs.FileSelector(f"{base}/{manifest_dir(t, c, d)}", allow_not_found=True)
                newer = latest_manifests(i.path[len(base) + 1 :] for i in fs.get_file_info(sel))
                if not newer:
                    return None
                key = next(iter(newer.values()))
        raise RuntimeError(f"lake manifest {key} keeps changing; retry")

    with ThreadPoolExecutor(16) as pool:
        return [m for m in pool.map(read, latest) if m is not None]


def plan(manifests: Iterable[Manifest], table: str, filters: Filters) -> list[FileEntry]:
    """The live files of ``table`` in ``manifests`` that ``filters`` may match."""
    filters.check(table)
    until_day = day_of(filters.until) if filters.until is not None else None
    out = []
    for m in manifests:
        if filters.cluster and m.cluster not in filters.cluster:
            continue
        # A run's rows live in the partition of the day it started, never before its tasks.
        if until_day is not None and m.day > until_day:
            continue
        out += [f for f in m.files if f.table == table and filters.file_may_match(f)]
    return out


def files(
    location: str,
    table: str,
    tenant: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    **filters: Any,
) -> list[LakeFile]:
    """The files of ``table`` a scan with ``filters`` reads, planned from the manifests."""
    f = Filters.from_kwargs(**filters)
    fs, base = filesystem(location, endpoint_url=endpoint_url, region=region)
    out = []
    for m in manifests(fs, base, tenant, f.cluster):
        for e in plan([m], table, f):
            out.append(
                LakeFile(table, m.cluster, m.day, f"{base}/{e.key}", e.rows, e.bytes, e.runs)
            )
    return out


def _partitioning() -> Any:
    import pyarrow as pa
    import pyarrow.dataset as ds

    return ds.partitioning(pa.schema([(n, pa.string()) for n in PARTITION_COLUMNS]), flavor="hive")


def dataset(
    location: str,
    table: str,
    tenant: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    **filters: Any,
) -> Any:
    """A ``pyarrow.dataset.Dataset`` of the files a scan with ``filters`` reads, with the
    partition columns (tenant, cluster, day). Apply ``Filters(...).expression(table)`` (or
    your own) when scanning it: planning prunes files, not rows."""
    import pyarrow.dataset as ds

    fs, base = filesystem(location, endpoint_url=endpoint_url, region=region)
    planned = files(location, table, tenant, endpoint_url=endpoint_url, region=region, **filters)
    return ds.dataset(
        [f.path for f in planned],
        schema=schema(table, with_partition=True),
        filesystem=fs,
        format="parquet",
        partitioning=_partitioning(),
        partition_base_dir=f"{base}/{ROOT}/{table}",
    )


def stored_columns(columns: Sequence[str] | None) -> list[str] | None:
    """The columns to read from a file for ``columns`` (None: all of them)."""
    if not columns:
        return None
    return [c for c in columns if c not in PARTITION_COLUMNS]


def read_file(
    fs: Any, path: str, table: str, filters: Filters, columns: Sequence[str] | None = None
) -> Any:
    """One lake file's rows matching ``filters`` (stored ``columns`` only, all if None), as
    a pyarrow Table."""
    import pyarrow.parquet as pq

    return pq.read_table(
        path,
        filesystem=fs,
        columns=None if columns is None else list(columns),
        filters=filters.expression(table),
    )


class _DirectPart:
    """Reads one planned file in a Dask task (picklable: a location, not a filesystem)."""

    def __init__(
        self,
        location: str,
        endpoint_url: str | None,
        region: str | None,
        table: str,
        filters: Filters,
        columns: Sequence[str] | None,
    ) -> None:
        self.location, self.endpoint_url, self.region = location, endpoint_url, region
        self.table, self.filters, self.columns = table, filters, list(columns or [])

    def __call__(self, file: LakeFile) -> Any:
        fs, _base = filesystem(self.location, endpoint_url=self.endpoint_url, region=self.region)
        t = read_file(fs, file.path, self.table, self.filters, stored_columns(self.columns))
        return to_pandas(with_partition_columns(t, file.cluster, file.day, self.columns))


class LocationPart:
    """Reads one file of a plan from ``/v1/lake/{table}/files`` straight from its
    ``location`` (a Dask task: picklable)."""

    def __init__(
        self,
        table: str,
        filters: Filters,
        columns: Sequence[str] | None,
        endpoint_url: str | None = None,
        region: str | None = None,
    ) -> None:
        self.table, self.filters, self.columns = table, filters, list(columns or [])
        self.endpoint_url, self.region = endpoint_url, region

    def __call__(self, file: dict[str, Any]) -> Any:
        fs, path = filesystem(file["location"], endpoint_url=self.endpoint_url, region=self.region)
        t = read_file(fs, path, self.table, self.filters, stored_columns(self.columns))
        return to_pandas(with_partition_columns(t, file["cluster"], file["day"], self.columns))


def with_partition_columns(
    table: Any, cluster: str, day: str, columns: Sequence[str] | None = None
) -> Any:
    """``table`` with ``cluster`` and ``day`` columns added (when ``columns`` asks for
    them, or always when it is empty)."""
    import pyarrow as pa

    for name, value in (("cluster", cluster), ("day", day)):
        if not columns or name in columns:
            table = table.append_column(name, pa.repeat(pa.scalar(value, pa.string()), len(table)))
    if columns:
        table = table.select(list(columns))
    return table


def dataframe(
    location: str,
    table: str,
    tenant: str,
    *,
    columns: Sequence[str] | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
    **filters: Any,
) -> Any:
    """A ``dask.dataframe`` of ``table``, one partition per planned file, read straight
    from the blob store (for operators with its credentials; users go through
    ``hindsight.Client.lake``). Columns ``cluster`` and ``day`` come from the partition."""
    import dask.dataframe as dd

    f = Filters.from_kwargs(**filters)
    planned = files(location, table, tenant, endpoint_url=endpoint_url, region=region, **filters)
    reader = _DirectPart(location, endpoint_url, region, table, f, columns)
    meta = empty_frame(table, columns)
    if not planned:
        return dd.from_pandas(meta, npartitions=1)
    return dd.from_map(reader, planned, meta=meta, enforce_metadata=False)


def empty_frame(table: str, columns: Sequence[str] | None = None) -> Any:
    """A pandas DataFrame with no rows and the columns (and dtypes) a read of ``table``
    gives: the meta of a Dask DataFrame over the lake."""
    s = schema(table)
    t = with_partition_columns(s.empty_table(), "", "", columns)
    return to_pandas(t)


def to_pandas(table: Any) -> Any:
    """A pyarrow Table as pandas, strings as pyarrow-backed ``string`` (what Dask keeps
    strings as: a partition in any other string dtype is converted, at a cost, per task)."""
    import pandas as pd
    import pyarrow as pa

    strings = pd.StringDtype("pyarrow")
    return table.to_pandas(types_mapper={pa.string(): strings, pa.large_string(): strings}.get)
