"""Building blocks of the query service's OpenAPI document: parameters, responses."""

from __future__ import annotations

from typing import Any

from services.common.openapi import AUTH_ERRORS, UNAVAILABLE, error, ok

limit_param = lambda default, hi: {  # noqa: E731
    "name": "limit",
    "in": "query",
    "schema": {"type": "integer", "minimum": 1, "maximum": hi, "default": default},
}
CURSOR = {"name": "cursor", "in": "query", "schema": {"type": "string", "maxLength": 256}}
time_param = lambda name, what: {  # noqa: E731
    "name": name,
    "in": "query",
    "description": f"{what}: epoch seconds or ISO 8601"
    + ("; a date alone (2026-11-21) includes that day (UTC)" if name == "until" else ""),
    "schema": {"type": "string", "maxLength": 256},
}
RUN_ID = {
    "name": "run_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "maxLength": 64},
}
NOT_FOUND = {"404": error("no such run for this tenant")}
BAD = {"400": error("invalid parameter")}


def get_op(
    summary: str, params: list[dict[str, Any]], schema: dict[str, Any], *extra: dict[str, Any]
) -> dict[str, Any]:
    responses: dict[str, Any] = {**ok(summary, schema), **BAD, **AUTH_ERRORS, **UNAVAILABLE}
    for e in extra:
        responses.update(e)
    return {"get": {"summary": summary, "parameters": params, "responses": responses}}


RUN_REF = {"$ref": "#/components/schemas/Run"}
query_param = lambda name, schema, desc=None: {  # noqa: E731
    "name": name,
    "in": "query",
    "schema": schema,
    **({"description": desc} if desc else {}),
}
string_schema = lambda n=1024: {"type": "string", "maxLength": n}  # noqa: E731
OBJECT = {"type": "object"}
ARRAY = {"type": "array", "items": OBJECT}
TASK_FILTERS = [
    query_param("prefix", string_schema(), "tasks of this prefix"),
    query_param("worker", string_schema(), "tasks that ran on this worker address"),
    query_param("status", string_schema(32), "memory, erred, or lost (Ray: no end arrived)"),
    time_param("since", "tasks that stopped at or after"),
    time_param("until", "tasks that started before"),
    query_param(
        "sort",
        {"type": "string", "enum": ["duration", "-duration", "start", "-start"]},
        "duration is compute seconds; '-' for descending",
    ),
]
ACTION = query_param(
    "action", string_schema(64), "compute (default), transfer, disk-read, disk-write"
)


def run_json_op(summary: str, props: dict[str, Any]) -> dict[str, Any]:
    return get_op(summary, [RUN_ID], {"type": "object", "properties": props}, NOT_FOUND)


STATS = {
    "type": "object",
    "properties": {
        k: {"type": ["number", "null"]}
        for k in ("count", "total", "mean", "min", "p50", "p90", "p99", "max")
    },
}
TIME_PROPS = {
    k: {"type": "number"} for k in ("capacity", "compute", "transfer", "spill", "other", "idle")
} | {"workers": ARRAY}


def binary_op(summary: str, mime: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    op = get_op(summary, params, OBJECT, NOT_FOUND)
    op["get"]["responses"]["200"]["content"] = {
        mime: {"schema": {"type": "string", "format": "binary"}}
    }
    return op
