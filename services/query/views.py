"""The query service's REST API: clusters, runs, one run, its tasks."""

from __future__ import annotations

from typing import Any

from flask import Blueprint

from services.common.params import arg, bad, choice_arg, int_arg, name_arg, time_arg
from services.common.web import ApiError, db, require, store
from storage import queries
from storage.queries import BadCursor, RunFilters

bp = Blueprint("query", __name__)

MAX_LIMIT = 10_000


def _run_or_404(run_id: str) -> Any:
    principal = require("read")
    if len(run_id) > 64:
        raise ApiError(404, "not_found", "no such run")
    found = queries.find_run(db(), principal.tenant_id, run_id)
    if found is None:
        raise ApiError(404, "not_found", f"no run {run_id!r}")
    return found


@bp.get("/v1/clusters")
def clusters() -> Any:
    principal = require("read")
    return {"clusters": queries.list_clusters(db(), principal.tenant_id)}


@bp.get("/v1/runs")
def runs() -> Any:
    principal = require("read")
    filters = RunFilters(
        cluster=name_arg("cluster"),
        status=choice_arg("status", queries.RUN_STATUSES),
        since=time_arg("since"),
        until=time_arg("until"),
    )
    limit = int_arg("limit", 100, 1, 1000)
    try:
        page, next_cursor = queries.list_runs(
            db(), principal.tenant_id, filters, limit, arg("cursor")
        )
    except BadCursor:
        raise bad("cursor", "not a cursor from this API") from None
    return {"runs": page, "next_cursor": next_cursor}


@bp.get("/v1/runs/<run_id>")
def run(run_id: str) -> Any:
    found = _run_or_404(run_id)
    return queries.run_detail(db(), *found)


@bp.get("/v1/runs/<run_id>/tasks")
def run_tasks(run_id: str) -> Any:
    run, _cluster, _session = _run_or_404(run_id)
    limit = int_arg("limit", 1000, 1, MAX_LIMIT)
    tasks: list[dict[str, Any]] = []
    next_cursor: str | None = None
    try:
        for record, cursor in queries.iter_run_tasks(db(), store().blobs, run, arg("cursor")):
            if len(tasks) == limit:
                break  # there is at least one more: hand out the cursor after the last
            tasks.append(record)
            next_cursor = cursor
        else:
            next_cursor = None
    except BadCursor:
        raise bad("cursor", "not a cursor from this API") from None
    return {"tasks": tasks, "next_cursor": next_cursor}
