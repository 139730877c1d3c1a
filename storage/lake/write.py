"""The history lake's Apache Iceberg tables: the catalog, commits, compaction and expiry.

Layout and filters: ``hindsight/lake.py``; what goes in (a run's rows) and when:
``storage/lake/build.py``; the user's view: docs/lake.md; why Iceberg:
docs/decisions/0032-lake-on-iceberg.md.

**The catalog** is pyiceberg's SQL catalog in the index database (its two tables,
``iceberg_tables`` and ``iceberg_namespace_properties``, next to Hindsight's own: the SQLite
file of ``hindsight serve``, Postgres for the full stack); the warehouse is
``{blob store}/lake/iceberg``; the tables are ``hindsight.tasks``, ``.metrics``, ``.runs``
and ``.streams``, partitioned by ``tenant``, ``cluster`` and ``day`` (identity: the UTC day
the run started, so all of a run's rows are in one partition per table).

**A commit** is one Iceberg transaction per table: a run new to the lake is appended; a
run that changed (a late batch) is overwritten with a row filter on the run, its old rows
deleted and its new rows added in one snapshot. Commits are optimistic: the catalog swaps
the table's metadata pointer only if no one else did meanwhile, else pyiceberg refreshes,
re-checks that nothing it deletes was changed, and retries (``commit.retry.*`` below), so
two collectors committing to one partition at once both land.

**Small files** are merged per partition: when a partition holds ``FANOUT`` or more small
files of one size tier (or below; tiers by rows, ``FANOUT``x apart), they are rewritten
into one sorted file in one snapshot; once the partition's day is over, every small file
is (sealing). **Old snapshots expire** after ``RETAIN_S``, and the files only they held
(data files replaced by overwrites, merges and deletes; their manifests and manifest lists)
are deleted then, so storage follows the data, not the number of commits, while a reader
that planned within ``RETAIN_S`` still finds every file it planned.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import urllib.parse
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from threading import Lock
from typing import Any

from hindsight import lake as layout
from storage.lake.spill import SortedRows

logger = logging.getLogger(__name__)

CATALOG = "hindsight"
NAMESPACE = "hindsight"
WAREHOUSE = "lake/iceberg"  # under the blob store's root
ROW_GROUP = 131_072
#: Rows of a full file per table; a file of at least half of it is never merged again.
TARGET_ROWS = {"tasks": 1_000_000, "metrics": 4_000_000, "runs": 1_000_000, "streams": 1_000_000}
BASE_ROWS = 16_384  # files below this are tier 0; each tier above holds FANOUT x more rows
FANOUT = 4
#: Seconds a snapshot stays readable after a newer one replaced it.
RETAIN_S = 3600.0
#: A finisher expires snapshots once the oldest has been due this long.
EXPIRE_EVERY_S = 300.0
SORT_KEYS = {
    "tasks": [("prefix", "ascending"), ("start", "ascending")],
    "metrics": [("name", "ascending"), ("worker", "ascending"), ("time", "ascending")],
    "runs": [("started_at", "ascending")],
    "streams": [("stream", "ascending"), ("time", "ascending")],
}
_BOUND_STRINGS = ("run", "session", "prefix", "status", "worker", "name", "stream", "key")
_BOUND_NUMBERS = ("start", "stop", "time", "started_at", "duration", "nbytes", "value", "makespan")
TABLE_PROPERTIES = {
    "format-version": "2",
    "write.parquet.compression-codec": "zstd",
    "write.parquet.row-group-limit": str(ROW_GROUP),
    # Manifests merge as commits add them, so planning reads a few manifests, not one per run.
    "commit.manifest-merge.enabled": "true",
    "commit.manifest.min-count-to-merge": "16",
    # Each commit writes a metadata file; the catalog points at the newest.
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "10",
    # Concurrent collectors: short waits, many tries (commits are small).
    "commit.retry.num-retries": "20",
    "commit.retry.min-wait-ms": "20",
    "commit.retry.max-wait-ms": "2000",
    "commit.retry.total-timeout-ms": "120000",
    # Bounds only of the columns filters and sorts use (others: counts), so manifests stay
    # small to keep and quick to decode; strings to 64 characters (a run id whole); the
    # partition columns always whole (add_files reads a file's partition from them).
    "write.metadata.metrics.default": "counts",
    **{f"write.metadata.metrics.column.{c}": "truncate(64)" for c in _BOUND_STRINGS},
    **{f"write.metadata.metrics.column.{c}": "full" for c in _BOUND_NUMBERS},
    **{f"write.metadata.metrics.column.{c}": "full" for c in layout.PARTITION_COLUMNS},
}


# ---------------------------------------------------------------- the catalog


@dataclass(frozen=True)
class Location:
    """Where the lake is: the index database and the blob store."""

    database_url: str
    blob_url: str
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"

    @property
    def warehouse(self) -> str:
        return f"{self.blob_url.rstrip('/')}/{WAREHOUSE}"

    @property
    def name(self) -> str:
        """The catalog's name: one index database may hold the catalogs of several blob
        stores (a staging and a production deployment on one Postgres database; the test
        suite), so the name is the warehouse's: ``hindsight_`` and a hash of it (an
        identifier Spark and Trino take as a catalog name without quotes)."""
        return f"{CATALOG}_{hashlib.sha256(self.warehouse.encode()).hexdigest()[:10]}"

    def key(self, path: str) -> str:
        """The blob key of a file the catalog names by its full location."""
        root = self.blob_url.rstrip("/") + "/"
        if not path.startswith(root):
            raise ValueError(f"{path} is not in the blob store {root}")
        return path[len(root) :]

    def properties(self, *, secrets: bool = True) -> dict[str, str]:
        """The properties of ``pyiceberg.catalog.load_catalog(CATALOG, **props)``. Without
        ``secrets``, the database password is left out (libpq takes it from PGPASSWORD or
        ~/.pgpass) and S3 credentials are never in them (the usual AWS variables)."""
        uri = _sqlalchemy_url(self.database_url, secrets)
        props = {"type": "sql", "uri": uri, "warehouse": self.warehouse}
        if self.blob_url.startswith("s3://"):
            props["s3.region"] = self.s3_region
            if self.s3_endpoint_url:
                props["s3.endpoint"] = self.s3_endpoint_url
        return props


def location_of(db: Any, blobs: Any) -> Location:
    """The lake's location from an index session and the blob store it writes to."""
    inner = getattr(blobs, "blobs", blobs)  # storage.runs.context.ReadOnce wraps the store
    url = db.get_bind().url.render_as_string(hide_password=False)
    return Location(
        url,
        _blob_root(blobs.url),
        getattr(inner, "endpoint_url", None),
        getattr(inner, "region", None) or "us-east-1",
    )


def location_from_settings(settings: Any) -> Location:
    return Location(
        settings.database_url,
        _blob_root(settings.blob_url),
        settings.s3_endpoint_url or None,
        settings.s3_region or "us-east-1",
    )


def _blob_root(url: str) -> str:
    """A blob store URL as its store spells it (the catalog's name derives from it: the
    finisher, given a store, and the services, given settings, must find one catalog)."""
    from pathlib import Path

    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        return Path(urllib.parse.unquote(parts.path)).as_uri()
    return url.rstrip("/")


def _sqlalchemy_url(url: str, secrets: bool) -> str:
    from sqlalchemy.engine import URL, make_url

    u = make_url(url)
    if u.get_backend_name() == "postgresql" and u.get_driver_name() in ("", "psycopg2"):
        u = u.set(drivername="postgresql+psycopg2")
    if not secrets:  # (URL.set keeps a field given None)
        u = URL.create(u.drivername, u.username, None, u.host, u.port, u.database, u.query)
    return u.render_as_string(hide_password=False)


_catalogs: dict[Location, Any] = {}
_catalogs_lock = Lock()


def catalog(loc: Location) -> Any:
    """The lake's catalog (one per process and location), its namespace and tables made
    on first use."""
    with _catalogs_lock:
        cat = _catalogs.get(loc)
        if cat is None:
            from pyiceberg.catalog.sql import SqlCatalog
            from sqlalchemy import create_engine
            from sqlalchemy.pool import NullPool

            props = loc.properties()
            props.pop("type")
            cat = SqlCatalog(loc.name, **props)
            # No pooled connections held by a catalog cached for the process's life: a
            # commit is a few statements, and an idle pool would hold the database open.
            cat.engine.dispose()
            cat.engine = create_engine(props["uri"], poolclass=NullPool)
            _ensure_tables(cat)
            _catalogs[loc] = cat
        return cat


def _ensure_tables(cat: Any) -> None:
    from pyiceberg.exceptions import NamespaceAlreadyExistsError, TableAlreadyExistsError

    try:
        cat.create_namespace(NAMESPACE)
    except NamespaceAlreadyExistsError:
        pass
    existing = {name for _ns, name in cat.list_tables(NAMESPACE)}
    for table in layout.TABLES:
        if table in existing:
            continue
        schema = iceberg_schema(table)
        try:
            cat.create_table(
                f"{NAMESPACE}.{table}",
                schema=schema,
                partition_spec=_partition_spec(schema),
                sort_order=_sort_order(schema, table),
                # Our files carry no Iceberg field ids: columns are mapped by name.
                properties={
                    **TABLE_PROPERTIES,
                    "schema.name-mapping.default": schema.name_mapping.model_dump_json(),
                },
            )
        except TableAlreadyExistsError:  # another process made it meanwhile
            pass


def iceberg_schema(table: str) -> Any:
    """The Iceberg schema of a lake table: its columns, then tenant, cluster and day."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import DoubleType, ListType, LongType, NestedField, StringType

    types = {"string": StringType(), "int64": LongType(), "float64": DoubleType()}
    cols = [*layout.COLUMNS[table], *((n, "string") for n in layout.PARTITION_COLUMNS)]
    fields, next_id = [], len(cols) + 1  # list elements take ids after the columns'
    for i, (name, kind) in enumerate(cols, start=1):
        if kind == "list<string>":
            t: Any = ListType(next_id, StringType(), element_required=False)
            next_id += 1
        else:
            t = types[kind]
        fields.append(NestedField(i, name, t, required=False))
    return Schema(*fields)


def _partition_spec(schema: Any) -> Any:
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.transforms import IdentityTransform

    return PartitionSpec(
        *(
            PartitionField(schema.find_field(n).field_id, 1000 + i, IdentityTransform(), n)
            for i, n in enumerate(layout.PARTITION_COLUMNS)
        )
    )


def _sort_order(schema: Any, table: str) -> Any:
    from pyiceberg.table.sorting import SortField, SortOrder
    from pyiceberg.transforms import IdentityTransform

    return SortOrder(
        *(
            SortField(schema.find_field(c).field_id, IdentityTransform())
            for c, _ in SORT_KEYS[table]
        )
    )


def table(loc: Location, name: str) -> Any:
    """The lake table ``name``, as the catalog has it now."""
    return catalog(loc).load_table(f"{NAMESPACE}.{name}")


# ---------------------------------------------------------------- data files

#: The Parquet footer key of a file's statistics (see ``_stats``).
STATS_KEY = b"hindsight.stats"


def _stats(table_name: str, t: Any) -> dict[str, Any]:
    """What pruning needs beyond Iceberg's column bounds (see docs/lake.md): tasks per
    prefix [rows, longest duration, largest nbytes, erred] and statuses; metric names;
    stream names. Kept in the file's Parquet footer; the query service caches it."""
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


def parquet_options(schema: Any) -> dict[str, Any]:
    """How lake files are encoded: zstd; floats (times, seconds, values) byte-stream-split
    rather than dictionary-encoded, which takes a task record from ~65 to ~49 bytes and
    writes faster (measured on bench/lake.py's records); dictionaries for the rest."""
    import pyarrow as pa

    floats = [f.name for f in schema if f.type == pa.float64()]
    others = [f.name for f in schema if f.type != pa.float64()]
    return {"compression": "zstd", "use_dictionary": others, "use_byte_stream_split": floats}


def write_files(tbl: Any, name: str, part: Partition, rows: Any, order: Any = None) -> list[str]:
    """Write a partition's rows (sorted, with the partition columns) as data files of at
    most ``TARGET_ROWS`` rows where pyiceberg would (``{table}/data/tenant=…/cluster=…/
    day=…/``), our statistics in each footer. Returns their locations, for ``add_files``.

    ``order``: the rows' sorted order (indices), when ``rows`` are not sorted: taken a row
    group at a time as the files are written, so a run's rows are never held twice (a
    sorted copy of a 10^6-task run's tasks was ~400 MB more at its finish)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    q = lambda v: urllib.parse.quote_plus(v, safe="")  # noqa: E731
    base = f"{tbl.location().rstrip('/')}/data/tenant={q(part.tenant)}/cluster={q(part.cluster)}"
    paths = []
    step = TARGET_ROWS[name]
    for i, start in enumerate(range(0, max(len(rows), 1), step)):
        if order is None:
            chunk = rows.slice(start, step)
            if not len(chunk):
                break
            stats = _stats(name, chunk)
        else:
            picked = order[start : start + step]
            if not len(picked):
                break
            stats = _stats(name, rows.select(STATS_COLUMNS[name]).take(picked))
        meta = {STATS_KEY: json.dumps(stats, separators=(",", ":")).encode()}
        schema = rows.schema.with_metadata(meta)
        path = f"{base}/day={q(part.day)}/{i:05d}-0-{uuid.uuid4()}.parquet"
        with tbl.io.new_output(path).create() as fh:
            with pq.ParquetWriter(fh, schema, **parquet_options(schema)) as w:
                if order is None:
                    w.write_table(chunk.replace_schema_metadata(meta), row_group_size=ROW_GROUP)
                else:
                    for lo in range(0, len(picked), ROW_GROUP):
                        group = rows.take(pa.array(picked[lo : lo + ROW_GROUP]))
                        w.write_table(group.replace_schema_metadata(meta))
        paths.append(path)
    return paths


def write_sorted_files(tbl: Any, name: str, part: Partition, rows: SortedRows) -> list[str]:
    """:func:`write_files` of a :class:`SortedRows`: its groups, with the partition columns,
    as data files of at most ``TARGET_ROWS`` rows, the statistics of each in its footer."""
    import pyarrow.parquet as pq

    q = lambda v: urllib.parse.quote_plus(v, safe="")  # noqa: E731
    base = f"{tbl.location().rstrip('/')}/data/tenant={q(part.tenant)}/cluster={q(part.cluster)}"
    paths: list[str] = []
    step = TARGET_ROWS[name]
    writer = fh = None
    stats: dict[str, Any] = {}
    written = 0

    def close() -> None:
        writer.add_key_value_metadata({STATS_KEY: json.dumps(stats, separators=(",", ":"))})
        writer.close()
        fh.close()

    try:
        for group in rows.groups():
            group = with_partition(group, name, part, sort=False)
            while len(group):
                if writer is None:
                    path = f"{base}/day={q(part.day)}/{len(paths):05d}-0-{uuid.uuid4()}.parquet"
                    fh = tbl.io.new_output(path).create()
                    writer = pq.ParquetWriter(fh, group.schema, **parquet_options(group.schema))
                    paths.append(path)
                    stats, written = {}, 0
                take = group.slice(0, step - written)
                group = group.slice(len(take))
                writer.write_table(take, row_group_size=ROW_GROUP)
                stats = _merge_stats(stats, _stats(name, take))
                written += len(take)
                if written >= step:
                    close()
                    writer = fh = None
        if writer is not None:
            close()
            writer = None
    except BaseException:
        if writer is not None:
            writer.close()
            fh.close()
        raise
    finally:
        rows.close()
    return paths


#: The columns :func:`_stats` reads of each table.
STATS_COLUMNS = {
    "tasks": ["prefix", "duration", "nbytes", "status"],
    "metrics": ["name"],
    "streams": ["stream"],
    "runs": [],
}


# ---------------------------------------------------------------- commits


@dataclass
class Partition:
    tenant: str
    cluster: str
    day: str

    def expression(self) -> Any:
        from pyiceberg.expressions import And, EqualTo

        return And(
            EqualTo("tenant", self.tenant),
            EqualTo("cluster", self.cluster),
            EqualTo("day", self.day),
        )

    def __str__(self) -> str:
        return f"{self.tenant}/{self.cluster}/{self.day}"


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


def with_partition(t: Any, table: str, part: Partition, *, sort: bool = True) -> Any:
    """A table's rows with the partition columns, sorted as the table's sort order says
    (unless ``sort`` is false: see :func:`sorted_order`)."""
    import pyarrow as pa

    schema = layout.schema(table)
    t = t.cast(schema) if t.schema != schema else t
    n = len(t)
    for name, value in (("tenant", part.tenant), ("cluster", part.cluster), ("day", part.day)):
        t = t.append_column(name, pa.repeat(pa.scalar(value, pa.string()), n))
    return t.sort_by(SORT_KEYS[table]) if n > 1 and sort else t


def sorted_order(t: Any, table: str) -> Any:
    """The order ``with_partition`` sorts a table's rows in, as indices (``sort_by`` takes
    the same), for :func:`write_files` to take a row group at a time."""
    import numpy as np
    import pyarrow.compute as pc

    if len(t) < 2:
        return np.arange(len(t), dtype=np.int64)
    return np.asarray(pc.sort_indices(t, sort_keys=SORT_KEYS[table]), dtype=np.int64)


def _run_filter(part: Partition, runs: Iterable[str], days: Iterable[str]) -> Any:
    from pyiceberg.expressions import And, EqualTo, In

    runs, days = sorted(set(runs)), sorted(set(days) | {part.day})
    cond = EqualTo("run", runs[0]) if len(runs) == 1 else In("run", runs)
    where = EqualTo("day", days[0]) if len(days) == 1 else In("day", days)
    return And(
        And(EqualTo("tenant", part.tenant), EqualTo("cluster", part.cluster)), And(where, cond)
    )


def commit_runs(
    loc: Location,
    part: Partition,
    add: Iterable[RunRows],
    *,
    replace: Iterable[str] = (),
    days: Iterable[str] = (),
) -> None:
    """Put runs into a partition: per table one Iceberg transaction that deletes the rows of
    the runs in ``replace`` (earlier versions, in this partition or the cluster's ``days``)
    and appends the new rows. The ``runs`` table goes last: a run in it has all its rows in
    the others."""
    import pyarrow as pa

    add = list(add)
    replace = set(replace)
    where = _run_filter(part, replace, days) if replace else None
    for name in ("tasks", "metrics", "streams", "runs"):
        parts = [r.tables[name] for r in add if len(r.tables[name])]
        big = [p for p in parts if isinstance(p, SortedRows)]
        if big and len(parts) > 1:
            raise ValueError("a run whose rows are sorted through files is committed alone")
        rows = (
            with_partition(pa.concat_tables(parts), name, part, sort=False)
            if parts and not big
            else None
        )
        tbl = table(loc, name)
        props = {"hindsight.runs": ",".join(r.run for r in add)[:4096]}
        # Deleting costs a plan and a snapshot: only where the lake may hold the runs. (Two
        # writers of one run at once cannot be: the finish queue leases a run to one.)
        held = replace and any(True for _ in tbl.scan(row_filter=where).plan_files())
        if big:
            paths = write_sorted_files(tbl, name, part, big[0])
        elif rows is not None:
            paths = write_files(tbl, name, part, rows, sorted_order(rows, name))
        else:
            paths = []
        if not held and not paths:
            continue
        try:
            with tbl.transaction() as txn, warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "did not match any records"
                if held:
                    txn.delete(where, snapshot_properties=props)
                if paths:
                    # The files are new, named by a fresh uuid: no need to look for them in
                    # the table (a scan of every manifest).
                    txn.add_files(paths, snapshot_properties=props, check_duplicate_files=False)
        except Exception:
            _discard(tbl, paths)  # never committed: no snapshot will ever name them
            raise


def append_partitions(loc: Location, name: str, parts: Iterable[tuple[Partition, Any]]) -> None:
    """Append rows of many partitions (each with its partition columns, sorted) to a table
    in one commit: a bulk load (bench/lake.py builds its lake so)."""
    tbl = table(loc, name)
    paths = [p for part, rows in parts if len(rows) for p in write_files(tbl, name, part, rows)]
    if paths:
        try:
            tbl.add_files(paths, check_duplicate_files=False)
        except Exception:
            _discard(tbl, paths)
            raise


def _discard(tbl: Any, paths: list[str]) -> None:
    for path in paths:
        try:
            tbl.io.delete(path)
        except (FileNotFoundError, OSError):
            logger.warning("lake: could not delete uncommitted %s", path)


def delete_rows(loc: Location, row_filter: Any) -> None:
    """Delete the rows matching ``row_filter`` from every table (retention, reconcile)."""
    for name in layout.TABLES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "did not match any records"
            table(loc, name).delete(row_filter)


# ---------------------------------------------------------------- compaction


def _tier(rows: int) -> int:
    tier, cap = 0, BASE_ROWS
    while rows >= cap:
        tier += 1
        cap *= FANOUT
    return tier


def _to_merge(name: str, files: list[Any], seal: bool) -> list[Any]:
    """The small files of a partition to rewrite as one: every one once the day is over
    (if there are two or more), else those of the lowest tiers once ``FANOUT`` of them
    are at that tier or below."""
    small = [f for f in files if f.record_count < TARGET_ROWS[name] // 2]
    if seal:
        return small if len(small) > 1 else []
    for tier in sorted({_tier(f.record_count) for f in small}):
        at_or_below = [f for f in small if _tier(f.record_count) <= tier]
        if len(at_or_below) >= FANOUT:
            return at_or_below
    return []


def compact(loc: Location, part: Partition, *, now: float | None = None) -> int:
    """Merge a partition's small files (see the module's doc). Returns files merged."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyiceberg.exceptions import CommitFailedException, ValidationException
    from pyiceberg.io.pyarrow import parquet_files_to_data_files

    now = time.time() if now is None else now
    seal = part.day < layout.day_of(now)
    merged = 0
    for name in layout.TABLES:
        tbl = table(loc, name)
        files = [t.file for t in tbl.scan(row_filter=part.expression()).plan_files()]
        chosen = _to_merge(name, files, seal)
        if not chosen:
            continue
        fs = tbl.io
        parts = []
        for f in chosen:
            with fs.new_input(f.file_path).open() as fh:
                parts.append(pq.read_table(fh))
        rows = (
            pa.concat_tables(parts, promote_options="permissive")
            .cast(layout.schema(name, with_partition=True))
            .sort_by(SORT_KEYS[name])
        )
        paths = write_files(tbl, name, part, rows)
        try:
            with tbl.transaction() as txn:
                with txn.update_snapshot(
                    snapshot_properties={"hindsight.merge": str(len(chosen))}
                ).overwrite() as ow:
                    for f in chosen:
                        ow.delete_data_file(f)
                    for df in parquet_files_to_data_files(tbl.io, txn.table_metadata, iter(paths)):
                        ow.append_data_file(df)
        except (CommitFailedException, ValidationException) as exc:
            # A run of the partition changed meanwhile: the next commit merges.
            logger.info("lake: merge of %s %s gave way to a concurrent commit: %s", name, part, exc)
            _discard(tbl, paths)
            continue
        merged += len(chosen)
    return merged


# ---------------------------------------------------------------- expiry


def expire(
    loc: Location, *, now: float | None = None, retain: float = RETAIN_S, every: float = 0.0
) -> int:
    """Expire snapshots older than ``retain`` seconds (the current one always stays) and
    delete the files only they held; with ``every``, only once the oldest has been due that
    long (expiring reads the manifests of every snapshot kept: a finisher does it every
    few minutes, not at each run). Returns files deleted."""
    now = time.time() if now is None else now
    deleted = 0
    for name in layout.TABLES:
        tbl = table(loc, name)
        cutoff_ms = int((now - retain) * 1000)
        current = tbl.metadata.current_snapshot_id
        old = [
            s
            for s in tbl.metadata.snapshots
            if s.timestamp_ms < cutoff_ms and s.snapshot_id != current
        ]
        if not old or min(s.timestamp_ms for s in old) > cutoff_ms - every * 1000:
            continue
        kept = [s for s in tbl.metadata.snapshots if s not in old]
        live_data, live_meta = _referenced(tbl, kept, live=True)
        gone_data, gone_meta = _referenced(tbl, old, live=False)
        tbl.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in old]).commit()
        for path in sorted((gone_data - live_data) | (gone_meta - live_meta)):
            try:
                tbl.io.delete(path)
                deleted += 1
            except FileNotFoundError:
                pass
    return deleted


def _referenced(tbl: Any, snapshots: list[Any], *, live: bool) -> tuple[set[str], set[str]]:
    """(data files, manifest lists and manifests) the snapshots reference; data files
    counted only where a snapshot holds them (``live``) or wherever they are named."""
    data: set[str] = set()
    meta: set[str] = set()
    seen: set[str] = set()
    for s in snapshots:
        meta.add(s.manifest_list)
        for mf in s.manifests(tbl.io):
            meta.add(mf.manifest_path)
            if mf.manifest_path in seen:
                continue
            seen.add(mf.manifest_path)
            for e in mf.fetch_manifest_entry(tbl.io, discard_deleted=live):
                data.add(e.data_file.file_path)
    return data, meta


def file_key(loc: Location, table_name: str, tenant: str, cluster: str, day: str, name: str) -> str:
    """The blob key of a data file of a partition by its name (the layout pyiceberg writes:
    ``{table location}/data/tenant=.../cluster=.../day=.../{name}``)."""
    q = lambda v: urllib.parse.quote_plus(v, safe="")  # noqa: E731
    base = table(loc, table_name).location().rstrip("/")
    return loc.key(f"{base}/data/tenant={q(tenant)}/cluster={q(cluster)}/day={q(day)}/{name}")
