"""``/v1/lake/...``: the history lake over REST, for the caller's tenant only.

- ``GET /v1/lake/{table}``: rows of tasks, metrics, runs or streams with filters, columns,
  sort and limit; JSON (at most 10,000 rows), or streamed Arrow IPC / Parquet of any size.
- ``GET /v1/lake/{table}/files``: the plan of a scan (the files its filters keep), which
  ``hindsight.Client.lake`` turns into one Dask partition per file;
- ``GET /v1/lake/{table}/files/{cluster}/{day}/{name}``: one planned file's matching rows
  as Arrow IPC (what each Dask partition reads).

Every plan is of the caller's tenant's partitions (the tenant is a partition column of each
Iceberg table, never taken from the request), and a file named in a path is looked up under
the caller's tenant's partition, so no filter, name or path can reach another tenant's rows.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from flask import Blueprint, Response, current_app, request

from hindsight import lake as layout
from hindsight.lake import Filters
from hindsight.schema import valid_name
from services.common.params import MAX_PARAM, arg, bad, choice_arg, float_arg, int_arg, time_arg
from services.common.web import ApiError, require, store, unavailable
from storage.lake import read as lakequery
from storage.lake import write as lakewrite
from storage.lake.read import PlannedFile, Sort

bp = Blueprint("lake", __name__)

JSON_LIMIT = 10_000
SORTED_LIMIT = 1_000_000
MAX_VALUES = 100
MAX_COLUMNS_PARAM = 2048
_RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ARROW = "application/vnd.apache.arrow.stream"
PARQUET = "application/vnd.apache.parquet"
#: Columns that hold JSON text; JSON answers decode them.
_JSON_COLUMNS = {"tasks": {"startstops", "attrs"}, "streams": {"value"}}
_LIST_PARAMS = ("cluster", "run", "session", "prefix", "status", "worker", "name", "stream", "key")
_FLOAT_PARAMS = (
    "min_duration",
    "max_duration",
    "min_nbytes",
    "max_nbytes",
    "min_value",
    "max_value",
    "min_makespan",
)

_PARAMS = {f.name for f in fields(Filters)} | {"columns", "sort", "format", "limit"}
MAX_KEY = 4096  # hindsight.schema.Key


def _location() -> lakewrite.Location:
    return lakewrite.location_from_settings(current_app.config["SETTINGS"])


def _table(table: str) -> str:
    if table not in layout.TABLES:
        raise ApiError(
            404, "not_found", f"no lake table {table[:64]!r} ({', '.join(layout.TABLES)})"
        )
    return table


def _values(name: str) -> list[str]:
    values = [v for v in request.args.getlist(name) if v != ""]
    if len(values) > MAX_VALUES:
        raise bad(name, f"at most {MAX_VALUES} values")
    for v in values:
        longest = MAX_KEY if name == "key" else MAX_PARAM * 4  # a key as long as a batch's
        if len(v) > longest:
            raise bad(name, f"longer than {longest} characters")
        if any(ord(ch) < 32 for ch in v):
            raise bad(name, "contains control characters")
        if name == "cluster" and not valid_name(v):
            raise bad(name, "not a valid cluster name")
        if name == "run" and not _RUN_ID.fullmatch(v):
            raise bad(name, "not a run id")
    return values


@dataclass
class LakeRequest:
    """A lake route's parameters, checked."""

    table: str
    filters: Filters
    columns: list[str]
    sort: Sort | None


def parse_request(table: str) -> LakeRequest:
    """Every parameter is checked for size and form before the table is looked up (so an
    oversized parameter is a 400 on any path), then against the table."""
    for name in request.args:
        if name not in _PARAMS:  # a typo filtered nothing and answered every row
            raise bad(
                name[:64], f"not a parameter of the lake routes ({', '.join(sorted(_PARAMS))})"
            )
        if name not in _LIST_PARAMS and name != "columns":
            arg(name)  # the size cap of every single-valued parameter
    f = Filters(since=time_arg("since"), until=time_arg("until"))
    for name in _LIST_PARAMS:
        setattr(f, name, _values(name))
    for name in _FLOAT_PARAMS:
        setattr(f, name, float_arg(name))
    columns_text = request.args.get("columns") or ""
    if len(columns_text) > MAX_COLUMNS_PARAM:
        raise bad("columns", f"longer than {MAX_COLUMNS_PARAM} characters")
    sort_text = arg("sort")
    table = _table(table)
    try:
        f.check(table)
    except ValueError as exc:
        raise bad(*str(exc).split(": ", 1)) from None
    return LakeRequest(table, f, _columns(table, columns_text), _sort(table, sort_text))


def _columns(table: str, text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    known = layout.columns_of(table)
    unknown = [c for c in names if c not in known]
    if unknown:
        raise bad("columns", f"no column {unknown[0]!r} in {table} (columns: {', '.join(known)})")
    if len(set(names)) != len(names):
        raise bad("columns", "a column is named twice")
    return names


def _sort(table: str, text: str | None) -> Sort | None:
    if text is None:
        return None
    column = text.removeprefix("-")
    types = dict(layout.COLUMNS[table])
    if column not in (*types, "cluster", "day") or types.get(column, "").startswith("list"):
        raise bad("sort", f"not a sortable column of {table}: {column!r}")
    return Sort(column, text.startswith("-"))


@bp.get("/v1/lake/<table>")
def lake_rows(table: str) -> Any:
    """Rows of a lake table: JSON by default, ``format=arrow`` or ``parquet`` streamed."""
    principal = require("read")
    req = parse_request(table)
    table, f, columns, sort = req.table, req.filters, req.columns, req.sort
    fmt = choice_arg("format", ("json", "arrow", "parquet")) or "json"
    if fmt == "json":
        limit: int | None = int_arg("limit", 1000, 1, JSON_LIMIT)
    elif sort is not None:
        limit = int_arg("limit", SORTED_LIMIT, 1, SORTED_LIMIT)
    else:
        limit = int_arg("limit", 0, 1, 10**12) or None
    files = lakequery.plan(_location(), principal.tenant, table, f)
    headers = {"X-Hindsight-Lake-Files": str(len(files))}
    if fmt == "json" or sort is not None:
        result = _scan(principal.tenant, table, files, f, columns, sort, limit or SORTED_LIMIT)
        headers["X-Hindsight-Lake-Files-Opened"] = str(result.files_opened)
        if fmt == "json":
            return (
                {
                    "table": table,
                    "rows": _json_rows(table, result.table),
                    "count": len(result.table),
                    "truncated": result.truncated,
                    "scan": {
                        "partitions": len({(p.cluster, p.day) for p in files}),
                        "files": result.files_planned,
                        "files_opened": result.files_opened,
                        "rows_in_opened_files": result.rows_in_opened_files,
                    },
                },
                200,
                headers,
            )
        parts: Any = [result.table] if len(result.table) else []
    else:
        parts = lakequery.batches(store().blobs, files, table, f, columns, limit)
    schema = _answer_schema(table, columns)
    body = _arrow_stream(schema, parts) if fmt == "arrow" else _parquet_stream(schema, parts)
    return Response(body, mimetype=ARROW if fmt == "arrow" else PARQUET, headers=headers)


def _scan(
    tenant: str,
    table: str,
    files: list[PlannedFile],
    f: Filters,
    columns: list[str],
    sort: Sort | None,
    limit: int,
) -> lakequery.ScanResult:
    blobs = store().blobs
    try:
        return lakequery.scan(blobs, files, table, f, columns, sort, limit)
    except FileNotFoundError:
        # A file of an expired snapshot (a plan older than its retention): plan again.
        files = lakequery.plan(_location(), tenant, table, f)
        try:
            return lakequery.scan(blobs, files, table, f, columns, sort, limit)
        except FileNotFoundError:
            raise unavailable("the lake changed during the scan; retry") from None


def _answer_schema(table: str, columns: list[str]) -> Any:
    schema = layout.schema(table, with_partition=True)
    names = columns or [n for n in schema.names if n != "tenant"]
    return schema.empty_table().select(names).schema


def _json_rows(table: str, t: Any) -> list[dict[str, Any]]:
    rows = t.to_pylist()
    decode = [c for c in t.column_names if c in _JSON_COLUMNS.get(table, ())]
    for row in rows:
        for c in decode:
            if row[c] is not None:
                row[c] = json.loads(row[c])
        if row.get("attrs", 0) is None:
            row["attrs"] = {}  # as the run routes give a task without any
    return rows


class _Chunks:
    """A write-only file object whose bytes are collected and handed out as they come."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> int:
        self.chunks.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        out, self.chunks = b"".join(self.chunks), []
        return out


def _arrow_stream(schema: Any, parts: Any) -> Iterator[bytes]:
    import pyarrow as pa

    sink = _Chunks()
    with pa.ipc.new_stream(sink, schema) as writer:
        yield sink.take()
        for t in parts:
            writer.write_table(t.cast(schema))
            yield sink.take()
    yield sink.take()


def _parquet_stream(schema: Any, parts: Any) -> Iterator[bytes]:
    import pyarrow.parquet as pq

    sink = _Chunks()
    writer = pq.ParquetWriter(sink, schema, compression="zstd")
    for t in parts:
        writer.write_table(t.cast(schema))
        yield sink.take()
    writer.close()
    yield sink.take()


@bp.get("/v1/lake/<table>/files")
def lake_files(table: str) -> Any:
    """The plan of a scan: one entry per file the filters keep."""
    principal = require("read")
    req = parse_request(table)
    table, f, columns = req.table, req.filters, req.columns
    files = lakequery.plan(_location(), principal.tenant, table, f)
    root = store().blobs.url.rstrip("/")
    schema = _answer_schema(table, columns)
    return {
        "table": table,
        "columns": schema.names,
        "schema": base64.b64encode(schema.serialize().to_pybytes()).decode(),
        "files": [
            {
                "cluster": p.cluster,
                "day": p.day,
                "name": p.name,
                "rows": p.rows,
                "bytes": p.bytes,
                "path": f"/v1/lake/{table}/files/{p.cluster}/{p.day}/{p.name}",
                "location": f"{root}/{p.key}",
            }
            for p in files
        ],
    }


@bp.get("/v1/lake/<table>/files/<cluster>/<day>/<name>")
def lake_file(table: str, cluster: str, day: str, name: str) -> Any:
    """One file's rows matching the filters, as Arrow IPC (a Dask partition's read)."""
    principal = require("read")
    req = parse_request(table)
    table, f, columns = req.table, req.filters, req.columns
    if not valid_name(cluster) or not layout.valid_day(day) or not layout.valid_file_name(name):
        raise ApiError(404, "not_found", "no such lake file")
    key = lakewrite.file_key(_location(), table, principal.tenant, cluster, day, name)
    planned = PlannedFile(cluster, day, key, 0, 0)
    try:
        t = lakequery.read_file(store().blobs, planned, table, f, columns)
    except FileNotFoundError:
        raise ApiError(
            404, "not_found", "no such lake file (merged and expired since it was planned?)"
        ) from None
    schema = _answer_schema(table, columns)
    return Response(_arrow_stream(schema, [t]), mimetype=ARROW)
