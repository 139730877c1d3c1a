"""The history lake's routes in the query service's OpenAPI document (docs/lake.md)."""

from __future__ import annotations

from services.common.openapi import error
from services.query.openapi_parts import (
    ARRAY,
    OBJECT,
    binary_op,
    get_op,
    query_param,
    string_schema,
    time_param,
)

_lake_table = {
    "name": "table",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "enum": ["tasks", "metrics", "runs", "streams"]},
}
_many = lambda name, desc, n=1024: {  # noqa: E731
    "name": name,
    "in": "query",
    "description": desc + " (repeat the parameter for several)",
    "schema": {"type": "array", "items": {"type": "string", "maxLength": n}, "maxItems": 100},
    "style": "form",
    "explode": True,
}
_number = lambda name, desc: query_param(name, {"type": "number"}, desc)  # noqa: E731
_lake_filters = [
    _many("cluster", "partitions of these clusters", 128),
    time_param("since", "rows overlapping the window from (tasks: stopped at or after)"),
    time_param("until", "rows overlapping the window to (tasks: started before)"),
    _many("run", "rows of these runs (ids)", 64),
    _many("session", "rows of these sessions"),
    _many("prefix", "tasks: of these prefixes"),
    _many("status", "tasks, runs: of these statuses", 32),
    _many("worker", "tasks, metrics, streams: on these workers"),
    _many("name", "metrics: these metric names; runs: these run names"),
    _many("stream", "streams: these emit() streams", 256),
    _many("key", "tasks, streams: these task keys", 4096),
    _number("min_duration", "tasks: duration (compute seconds) at least"),
    _number("max_duration", "tasks: duration (compute seconds) at most"),
    _number("min_nbytes", "tasks, runs: bytes at least"),
    _number("max_nbytes", "tasks, runs: bytes at most"),
    _number("min_value", "metrics: value at least"),
    _number("max_value", "metrics: value at most"),
    _number("min_makespan", "runs: makespan at least (seconds)"),
    query_param(
        "columns",
        string_schema(2048),
        "comma-separated columns (default: all, with cluster and day)",
    ),
]
_lake_rows = get_op(
    "Rows of a lake table across runs and clusters: filters, columns, sort, limit. JSON (at "
    "most 10,000 rows) or, with format=arrow|parquet, streamed Arrow IPC / Parquet of any size",
    [
        _lake_table,
        *_lake_filters,
        query_param("sort", string_schema(64), "a column, '-' for descending"),
        {
            "name": "limit",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1},
            "description": "JSON: 1,000 by default, at most 10,000; sorted Arrow/Parquet: "
            "at most 1,000,000; unsorted Arrow/Parquet: every row by default",
        },
        query_param("format", {"type": "string", "enum": ["json", "arrow", "parquet"]}),
    ],
    {
        "type": "object",
        "properties": {
            "table": {"type": "string"},
            "rows": ARRAY,
            "count": {"type": "integer"},
            "truncated": {"type": "boolean"},
            "scan": OBJECT,
        },
    },
    {"404": error("no such lake table")},
)
_lake_rows["get"]["responses"]["200"]["content"].update(
    {
        "application/vnd.apache.arrow.stream": {"schema": {"type": "string", "format": "binary"}},
        "application/vnd.apache.parquet": {"schema": {"type": "string", "format": "binary"}},
    }
)
_lake_file = binary_op(
    "One planned lake file's rows matching the filters, as Arrow IPC (a Dask partition's read)",
    "application/vnd.apache.arrow.stream",
    [
        _lake_table,
        {"name": "cluster", "in": "path", "required": True, "schema": string_schema(128)},
        {"name": "day", "in": "path", "required": True, "schema": string_schema(10)},
        {"name": "name", "in": "path", "required": True, "schema": string_schema(64)},
        *_lake_filters,
    ],
)
_lake_file["get"]["responses"]["404"] = error("no such lake file (or table)")
LAKE_PATHS = dict(
    {
        "/v1/lake/{table}": _lake_rows,
        "/v1/lake/{table}/files": get_op(
            "The plan of a lake scan: the files its filters keep (partition and statistics "
            "pruning), each with its rows, bytes, and where to read it",
            [_lake_table, *_lake_filters],
            {
                "type": "object",
                "properties": {
                    "table": {"type": "string"},
                    "columns": {"type": "array"},
                    "schema": {"type": "string", "description": "Arrow IPC schema, base64"},
                    "files": ARRAY,
                },
            },
            {"404": error("no such lake table")},
        ),
        "/v1/lake/{table}/files/{cluster}/{day}/{name}": _lake_file,
    }
)
