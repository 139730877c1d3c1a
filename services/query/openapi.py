"""The query service's OpenAPI document."""

from __future__ import annotations

from typing import Any

from services.common.openapi import AUTH_ERRORS, UNAVAILABLE, document, error, ok

_limit = lambda default, hi: {  # noqa: E731
    "name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": hi, "default": default},
}  # fmt: skip
_cursor = {"name": "cursor", "in": "query", "schema": {"type": "string", "maxLength": 256}}
_time = lambda name, what: {  # noqa: E731
    "name": name, "in": "query", "description": f"{what}: epoch seconds or ISO 8601",
    "schema": {"type": "string", "maxLength": 256},
}  # fmt: skip
_run_id = {
    "name": "run_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "maxLength": 64},
}
_not_found = {"404": error("no such run for this tenant")}
_bad = {"400": error("invalid parameter")}


def _get(
    summary: str, params: list[dict[str, Any]], schema: dict[str, Any], *extra: dict[str, Any]
) -> dict[str, Any]:
    responses: dict[str, Any] = {**ok(summary, schema), **_bad, **AUTH_ERRORS, **UNAVAILABLE}
    for e in extra:
        responses.update(e)
    return {"get": {"summary": summary, "parameters": params, "responses": responses}}


_run = {"$ref": "#/components/schemas/Run"}
PATHS = {
    "/v1/clusters": _get(
        "Clusters of the caller's tenant",
        [],
        {
            "type": "object",
            "properties": {"clusters": {"type": "array", "items": {"type": "object"}}},
        },
    ),
    "/v1/runs": _get(
        "Runs, newest first, with filters and cursor pagination",
        [
            {"name": "cluster", "in": "query", "schema": {"type": "string", "maxLength": 128}},
            {
                "name": "status",
                "in": "query",
                "schema": {"type": "string", "enum": ["running", "finished", "erred"]},
            },
            _time("since", "runs started at or after"),
            _time("until", "runs started before"),
            _limit(100, 1000),
            _cursor,
        ],
        {
            "type": "object",
            "properties": {
                "runs": {"type": "array", "items": _run},
                "next_cursor": {"type": ["string", "null"]},
            },
        },
    ),
    "/v1/runs/{run_id}": _get(
        "One run: status, times, counts, per-prefix rollups, completeness",
        [_run_id],
        _run,
        _not_found,
    ),
    "/v1/runs/{run_id}/tasks": _get(
        "A run's task records, read from the blob store",
        [_run_id, _limit(1000, 10000), _cursor],
        {
            "type": "object",
            "properties": {
                "tasks": {"type": "array", "items": {"type": "object"}},
                "next_cursor": {"type": ["string", "null"]},
            },
        },
        _not_found,
    ),
}

RUN = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "name": {"type": ["string", "null"]},
        "cluster": {"type": "string"},
        "session": {"type": "string"},
        "status": {"type": "string", "enum": ["running", "finished", "erred"]},
        "started_at": {"type": ["number", "null"]},
        "finished_at": {"type": ["number", "null"]},
        "makespan": {"type": ["number", "null"]},
        "task_count": {"type": "integer"},
        "error_count": {"type": "integer"},
    },
}

OPENAPI = document("Hindsight query service", PATHS, {"Run": RUN})
