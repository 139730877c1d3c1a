"""The history lake: every task, metric sample, emitted value and run summary of every
finished run, as Apache Iceberg tables (docs/lake.md).

This module is the one definition of the lake's columns and its filters, and of reading
it without a server. The server writes the lake (``storage/lake/``) and answers
``/v1/lake/...`` with it. The tables are ``hindsight.tasks``, ``.metrics``, ``.runs`` and
``.streams`` in an Iceberg SQL catalog (``hindsight lake catalog`` prints its properties):
any engine that reads Iceberg reads them; ``dataframe()`` here gives a ``dask.dataframe``
with one partition per data file the catalog plans.

Partitions: ``tenant``, ``cluster`` and ``day`` (identity), columns of every table; ``day``
is the UTC date the run started, so all rows of a run live in one partition per table.

pyarrow, pyiceberg, and dask for ``dataframe()``, are imported when first needed.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, date, datetime, timedelta
from typing import Any

NAMESPACE = "hindsight"
TABLES = ("tasks", "metrics", "runs", "streams")
#: Partition columns (identity partitions, in path order), stored in every file too.
PARTITION_COLUMNS = ("tenant", "cluster", "day")

#: Data file names as pyiceberg writes them: {task}-{n}-{write uuid}(-{counter}).parquet
_FILE_RE = re.compile(
    r"^\d{5}-\d+-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}(-\d+)?\.parquet$"
)
_DAY_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


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
        ("tag", "string"),  # the version of the run's rows (storage/lake/build.py)
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

    def iceberg(self, table: str, tenant: str) -> Any:
        """The scan's condition as a pyiceberg expression, the tenant's partitions only: the
        partition filter (tenant, clusters, days up to ``until``) and every row condition,
        which the Iceberg planner checks against each data file's column bounds."""
        from pyiceberg import expressions as ex

        conds: list[Any] = [ex.EqualTo("tenant", tenant)]
        if self.cluster:
            conds.append(ex.In("cluster", self.cluster))
        if self.until is not None:
            # A run's rows live in the partition of the day it started, before any of them.
            conds.append(ex.LessThanOrEqual("day", day_of(self.until)))
        lo_col, hi_col = TIME_COLUMNS[table]
        if self.since is not None:
            conds.append(ex.GreaterThanOrEqual(hi_col, self.since))
        if self.until is not None:
            conds.append(ex.LessThan(lo_col, self.until))
        for name, (col, _tables) in _LIST_FILTERS.items():
            values = getattr(self, name)
            if values:
                conds.append(ex.In(col, values) if len(values) > 1 else ex.EqualTo(col, values[0]))
        for name, (col, op, _tables) in _RANGE_FILTERS.items():
            value = getattr(self, name)
            if value is not None:
                if col == "nbytes" and float(value) != int(value):  # a long column
                    value = math.ceil(value) if op == ">=" else math.floor(value)
                value = int(value) if col == "nbytes" else float(value)
                cond = ex.GreaterThanOrEqual if op == ">=" else ex.LessThanOrEqual
                conds.append(cond(col, value))
        out = conds[0]
        for c in conds[1:]:
            out = ex.And(out, c)
        return out


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


def catalog(**props: Any) -> Any:
    """The lake's Iceberg catalog from the properties ``hindsight lake catalog`` prints
    (``name`` and ``namespace`` among them are taken here; the rest go to pyiceberg)."""
    from pyiceberg.catalog import load_catalog

    props = {k: v for k, v in props.items() if k not in ("namespace",)}
    return load_catalog(props.pop("name", NAMESPACE), **props)


@dataclass
class LakeFile:
    """One data file a scan reads: where it is and what it holds."""

    table: str
    cluster: str
    day: str
    path: str  # its full location, e.g. s3://bucket/prefix/lake/iceberg/hindsight/tasks/data/...
    rows: int
    bytes: int

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[1]


def plan(iceberg_table: Any, table: str, tenant: str, filters: Filters) -> list[LakeFile]:
    """The data files of ``tenant``'s rows of ``table`` that ``filters`` may match, as the
    Iceberg table's current snapshot plans them (partition and column statistics pruning),
    in partition order."""
    filters.check(table)
    tasks = iceberg_table.scan(row_filter=filters.iceberg(table, tenant)).plan_files()
    out = []
    for t in tasks:
        f = t.file
        cluster, day = f.partition[1], f.partition[2]
        out.append(LakeFile(table, cluster, day, f.file_path, f.record_count, f.file_size_in_bytes))
    out.sort(key=lambda f: (f.day, f.cluster, f.path))
    return out


def filesystem(
    location: str, *, endpoint_url: str | None = None, region: str | None = None
) -> tuple[Any, str]:
    """(pyarrow filesystem, path) for a location: ``s3://bucket/key``, ``file:///path`` or
    a local path. S3 credentials come from the usual AWS variables, files or instance
    roles."""
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


def answer_columns(table: str, columns: Sequence[str] | None) -> list[str]:
    """The columns a read gives: ``columns``, or every column but ``tenant``."""
    return list(columns) if columns else list(columns_of(table))


def read_file(
    fs: Any, path: str, table: str, filters: Filters, columns: Sequence[str] | None = None
) -> Any:
    """One data file's rows matching ``filters`` (``columns``, else all but ``tenant``), as
    a pyarrow Table in the lake's Arrow schema."""
    import pyarrow.parquet as pq

    names = answer_columns(table, columns)
    t = pq.read_table(path, filesystem=fs, columns=names, filters=filters.expression(table))
    return conform(t, table, names)


def conform(t: Any, table: str, names: Sequence[str]) -> Any:
    """``t`` in the lake's Arrow types (Iceberg files may hold large strings) and order."""
    full = schema(table, with_partition=True)
    target = full.empty_table().select(list(names)).schema
    t = t.select(list(names))
    return t if t.schema.equals(target) else t.cast(target)


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
        return to_pandas(read_file(fs, path, self.table, self.filters, self.columns))


def dataframe(
    props: dict[str, Any],
    table: str,
    tenant: str,
    *,
    columns: Sequence[str] | None = None,
    **filters: Any,
) -> Any:
    """A ``dask.dataframe`` of ``tenant``'s rows of ``table``, one partition per data file
    the catalog (``props``: what ``hindsight lake catalog`` prints) plans, read straight
    from the blob store (for operators with its credentials; users go through
    ``hindsight.Client.lake``)."""
    import dask.dataframe as dd

    f = Filters.from_kwargs(**filters)
    cat = catalog(**props)
    planned = plan(cat.load_table(f"{NAMESPACE}.{table}"), table, tenant, f)
    reader = LocationPart(
        table, f, columns, endpoint_url=props.get("s3.endpoint"), region=props.get("s3.region")
    )
    meta = empty_frame(table, columns)
    if not planned:
        return dd.from_pandas(meta, npartitions=1)
    located = [{"location": p.path, "cluster": p.cluster, "day": p.day} for p in planned]
    return dd.from_map(reader, located, meta=meta, enforce_metadata=False)


def empty_frame(table: str, columns: Sequence[str] | None = None) -> Any:
    """A pandas DataFrame with no rows and the columns (and dtypes) a read of ``table``
    gives: the meta of a Dask DataFrame over the lake."""
    full = schema(table, with_partition=True)
    return to_pandas(full.empty_table().select(answer_columns(table, columns)))


def to_pandas(table: Any) -> Any:
    """A pyarrow Table as pandas, strings as pyarrow-backed ``string`` (what Dask keeps
    strings as: a partition in any other string dtype is converted, at a cost, per task)."""
    import pandas as pd
    import pyarrow as pa

    strings = pd.StringDtype("pyarrow")
    return table.to_pandas(types_mapper={pa.string(): strings, pa.large_string(): strings}.get)
