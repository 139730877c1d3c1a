"""The query service's REST API: clusters, runs, one run in depth, comparisons, histories
and exports. Every route needs the ``read`` scope and answers only the caller's tenant."""

from __future__ import annotations

import io
import logging
import re
import time
from typing import Any

import msgspec
from flask import Blueprint, Response

from hindsight.schema import valid_name
from services.common.params import (
    arg,
    bad,
    bool_arg,
    choice_arg,
    float_arg,
    int_arg,
    label_arg,
    name_arg,
    time_arg,
)
from services.common.web import ApiError, db, require, store
from storage.analysis import flame, tasks
from storage.analysis.critical_path import critical_path
from storage.analysis.errors import errors as error_groups
from storage.analysis.profile import Profile
from storage.analysis.runfacts import display_name
from storage.analysis.trace import chrome_trace
from storage.core import models as m
from storage.query import activity, explain, history, replay, task_stream
from storage.query import compare as comparison
from storage.query import runs as queries
from storage.query.breakdown import time_breakdown
from storage.query.runs import BadCursor, RunFilters
from storage.query.summary import prefix_summary
from storage.runs import profiles, runcode, runfile, runlogs

logger = logging.getLogger(__name__)

bp = Blueprint("query", __name__)

MAX_LIMIT = 10_000
_RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
STREAM_CHUNK = 10_000


def _run_or_404(run_id: str) -> Any:
    principal = require("read")
    if not _RUN_ID.fullmatch(run_id):  # public ids are UUIDs; nothing else can match
        raise ApiError(404, "not_found", f"no run {run_id[:64]!r}")
    found = queries.find_run(db(), principal.tenant_id, run_id)
    if found is None:
        raise ApiError(404, "not_found", f"no run {run_id!r}")
    return found


def _run_data(run: Any) -> runfile.RunData:
    return runfile.load_run(db(), store().blobs, run)


@bp.get("/v1/clusters")
def clusters() -> Any:
    principal = require("read")
    return {"clusters": queries.list_clusters(db(), principal.tenant_id)}


@bp.get("/v1/runs")
def runs() -> Any:
    principal = require("read")
    name = label_arg("name", 1024)
    filters = RunFilters(
        cluster=name_arg("cluster"),
        status=choice_arg("status", queries.RUN_STATUSES),
        since=time_arg("since"),
        until=time_arg("until"),
        name=name,
        min_duration=float_arg("min_duration", 0.0),
        has_errors=bool_arg("has_errors"),
    )
    sort = choice_arg("sort", queries.RUN_SORTS) or "-started_at"
    limit = int_arg("limit", 100, 1, 1000)
    try:
        page, next_cursor = queries.list_runs(
            db(), principal.tenant_id, filters, limit, arg("cursor"), sort
        )
    except BadCursor:
        raise bad("cursor", "not a cursor from this API for this sort") from None
    return {"runs": page, "next_cursor": next_cursor}


@bp.get("/v1/runs/<run_id>")
def run(run_id: str) -> Any:
    found = _run_or_404(run_id)
    return {
        **queries.run_detail(db(), *found, silence=store().settings.silent_agents_seconds),
        "code": runcode.run_code(db(), found[0].id),
        "session_info": runlogs.session_facts(db(), found[0]),
    }


def _task_query(run: Any, lazy: bool = False) -> Any:
    """The filtered, sorted tasks table; with ``lazy``, None when there is nothing to
    filter or sort (the caller then reads only the rows of its page)."""
    filters = tasks.TaskFilters(
        prefix=label_arg("prefix", 1024),
        worker=label_arg("worker", 1024),
        status=label_arg("status", 32),
        since=time_arg("since"),
        until=time_arg("until"),
    )
    sort = choice_arg("sort", tasks.TASK_SORTS)
    if lazy and sort is None and filters == tasks.TaskFilters():
        return None, sort
    return tasks.filter_tasks(_run_data(run), filters, sort), sort


def _cursor_offset(what: str, mismatch: str) -> int:
    """The offset in the ``cursor`` argument (0 without one), a cursor made by
    :func:`_next_cursor` for ``what`` (a sort, a table); 400 ``mismatch`` for another's."""
    cursor = arg("cursor")
    if not cursor:
        return 0
    try:
        got, offset = queries.decode_cursor(cursor, (str, int))
    except BadCursor:
        raise bad("cursor", "not a cursor from this API") from None
    if got != what or offset < 0:
        raise bad("cursor", mismatch)
    return offset


def _next_cursor(what: str, end: int, total: int) -> str | None:
    return queries.encode_cursor(what, end) if end < total else None


@bp.get("/v1/runs/<run_id>/tasks")
def run_tasks(run_id: str) -> Any:
    run, _cluster, _session = _run_or_404(run_id)
    limit = int_arg("limit", 1000, 1, MAX_LIMIT)
    table, sort = _task_query(run, lazy=True)
    offset = _cursor_offset(sort or "", "not a cursor for this sort")
    page, total = (
        (table.slice(offset, limit), len(table))
        if table is not None
        else runfile.task_slice(db(), store().blobs, run, offset, limit)
    )
    records = tasks.task_records(page, run.run_key)
    next_cursor = _next_cursor(sort or "", offset + len(page), total)
    return {"tasks": records, "total": total, "next_cursor": next_cursor}


@bp.get("/v1/runs/<run_id>/tasks/stream")
def run_tasks_stream(run_id: str) -> Any:
    """Every matching task as NDJSON, one record a line, written as it is produced."""
    run, _cluster, _session = _run_or_404(run_id)
    table, _sort = _task_query(run)
    enc = msgspec.json.Encoder()

    def lines() -> Any:
        for start in range(0, len(table), STREAM_CHUNK):
            records = tasks.task_records(table.slice(start, STREAM_CHUNK), run.run_key)
            yield b"".join(enc.encode(r) + b"\n" for r in records)

    return Response(lines(), mimetype="application/x-ndjson")


@bp.get("/v1/runs/<run_id>/tasks.parquet")
def run_tasks_parquet(run_id: str) -> Any:
    """The run's compacted tasks file as it is stored (built now if needed); with the
    task routes' filters or sort, a file of the matching rows, in the same columns."""
    run, _cluster, _session = _run_or_404(run_id)
    blobs = store().blobs
    table, _sort = _task_query(run, lazy=True)
    limit = int_arg("limit", 0, 1, 2**62) or None
    if table is None and limit is not None:
        table = _run_data(run).tasks
    if table is not None and limit is not None:
        table = table.slice(0, limit)  # the first rows of the answer (after the sort)
    key = runfile.compacted_tasks_key(db(), blobs, run) if table is None else None
    if key is not None:
        body = blobs.get(key)
    else:  # filtered, or a running run: a snapshot, not stored
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(_run_data(run).tasks if table is None else table, buf, compression="zstd")
        body = buf.getvalue()
    return Response(
        body,
        mimetype="application/vnd.apache.parquet",
        headers={"Content-Disposition": f'attachment; filename="{run.public_id}-tasks.parquet"'},
    )


@bp.get("/v1/runs/<run_id>/summary")
def run_summary(run_id: str) -> Any:
    run, _c, _s = _run_or_404(run_id)
    return {"run": run.public_id, "prefixes": prefix_summary(db(), run)}


@bp.get("/v1/runs/<run_id>/metrics")
def run_metrics(run_id: str) -> Any:
    run, _c, _s = _run_or_404(run_id)
    points = int_arg("points", 500, 2, 10_000)
    series = tasks.metric_series(
        _run_data(run), points, worker=label_arg("worker", 1024), name=label_arg("name", 256)
    )
    return {"run": run.public_id, "series": series}


@bp.get("/v1/runs/<run_id>/progress")
def run_progress(run_id: str) -> Any:
    run, _c, _s = _run_or_404(run_id)
    buckets = int_arg("buckets", 50, 1, 1000)
    return {"run": run.public_id, **tasks.progress(_run_data(run), buckets)}


@bp.get("/v1/runs/<run_id>/graph")
def run_graph(run_id: str) -> Any:
    run, _c, _s = _run_or_404(run_id)
    return {"run": run.public_id, **tasks.graph(_run_data(run))}


@bp.get("/v1/runs/<run_id>/errors")
def run_errors(run_id: str) -> Any:
    run, _c, _s = _run_or_404(run_id)
    return {"run": run.public_id, "groups": error_groups(_run_data(run))}


@bp.get("/v1/runs/<run_id>/critical-path")
def run_critical_path(run_id: str) -> Any:
    run, _c, _s = _run_or_404(run_id)
    return {"run": run.public_id, **critical_path(_run_data(run))}


@bp.get("/v1/runs/<run_id>/time")
def run_time(run_id: str) -> Any:
    run, _c, _s = _run_or_404(run_id)
    return {"run": run.public_id, **time_breakdown(db(), [run.id])}


@bp.get("/v1/runs/<run_id>/regressions")
def run_regressions(run_id: str) -> Any:
    run, _c, _s = _run_or_404(run_id)
    baseline = int_arg("baseline", 5, 1, 100)
    threshold = float_arg("threshold", 0.0, 10_000.0)
    action = label_arg("action", 64) or "compute"
    return comparison.regressions(
        db(),
        run,
        baseline,
        20.0 if threshold is None else threshold,
        action,
        same_cluster=bool(bool_arg("same_cluster")),
    )


@bp.get("/v1/runs/<run_id>/explain")
def run_explain(run_id: str) -> Any:
    """Why the run was slower or faster than its job's usual runs (or than ``baseline``)."""
    run, _c, _s = _run_or_404(run_id)
    other = arg("baseline")
    base = _run_or_404(other)[0] if other is not None else None
    if base is not None and base.id == run.id:
        raise bad("baseline", "must be another run than the one explained")
    return explain.explanation(db(), store().blobs, run, base)


@bp.get("/v1/runs/<run_id>/trace")
def run_trace(run_id: str) -> Any:
    """Chrome trace-event JSON; open it in Perfetto (ui.perfetto.dev) or chrome://tracing."""
    run, _c, _s = _run_or_404(run_id)
    trace = chrome_trace(_run_data(run), display_name(run.name, run.run_key) or run.run_key)
    return Response(
        msgspec.json.encode(trace),
        mimetype="application/json",
        headers={"Content-Disposition": f'attachment; filename="{run.public_id}-trace.json"'},
    )


def _two_runs() -> tuple[Any, Any]:
    """Runs ``a`` and ``b`` of a comparison (both required)."""
    a_id, b_id = arg("a"), arg("b")
    if a_id is None or b_id is None:
        require("read")
        raise bad("a" if a_id is None else "b", "required: a run id")
    return _run_or_404(a_id)[0], _run_or_404(b_id)[0]


@bp.get("/v1/compare")
def compare() -> Any:
    a, b = _two_runs()
    return comparison.compare(db(), a, b, label_arg("action", 64) or "compute")


@bp.get("/v1/clusters/<cluster>/time")
def cluster_time(cluster: str) -> Any:
    principal = require("read")
    if not valid_name(cluster):
        raise bad("cluster", "not a valid name")
    since, until = time_arg("since"), time_arg("until")  # a bad one is a 400 either way
    breakdown = history.cluster_time_breakdown(db(), principal.tenant_id, cluster, since, until)
    if breakdown is None:  # not zeros, as if it had run nothing
        raise ApiError(404, "not_found", f"no cluster {cluster!r} (GET /v1/clusters lists them)")
    return {"cluster": cluster, **breakdown}


@bp.get("/v1/history/prefixes")
def prefix_history() -> Any:
    principal = require("read")
    prefix = label_arg("prefix", 1024)
    if prefix is None:
        raise bad("prefix", "required")
    action = label_arg("action", 64) or "compute"
    bucket = choice_arg("bucket", tuple(history.BUCKETS)) or "hour"
    points = history.prefix_history(
        db(),
        principal.tenant_id,
        prefix,
        action,
        bucket,
        time_arg("since"),
        time_arg("until"),
        name_arg("cluster"),
    )
    return {"prefix": prefix, "action": action, "bucket": bucket, "points": points}


@bp.get("/v1/history/clusters")
def cluster_history() -> Any:
    principal = require("read")
    bucket = choice_arg("bucket", tuple(history.BUCKETS)) or "hour"
    points = history.cluster_history(
        db(), principal.tenant_id, bucket, time_arg("since"), time_arg("until"), name_arg("cluster")
    )
    return {"bucket": bucket, "points": points}


# -- why a run was slow: profiles, fine performance metrics (issue 9) -------------------
PROFILE_FORMATS = ("json", "collapsed", "speedscope")


def _profile_answer(p: Profile, title: str, fmt: str, **extra: Any) -> Any:
    if fmt == "collapsed":
        return Response(flame.collapsed(p), mimetype="text/plain")
    if fmt == "speedscope":
        return Response(
            msgspec.json.encode(flame.speedscope(p, title)), mimetype="application/json"
        )
    return flame.summary(p, **extra)


@bp.get("/v1/runs/<run_id>/profile")
def run_profile(run_id: str) -> Any:
    """The run's statistical profile (merged call tree), of one prefix and/or worker."""
    run, _c, _s = _run_or_404(run_id)
    prefix, worker = label_arg("prefix", 1024), label_arg("worker", 1024)
    fmt = choice_arg("format", PROFILE_FORMATS) or "json"
    p = profiles.load(db(), store().blobs, run, prefix=prefix, worker=worker)
    name = " ".join(x for x in (run.name or run.run_key, prefix, worker) if x)
    return _profile_answer(p, name, fmt, run=run.public_id, prefix=prefix, worker=worker)


@bp.get("/v1/runs/<run_id>/state")
def run_state(run_id: str) -> Any:
    """Replay: the run's task states by prefix and the workers at ``at`` (default now;
    Dask's status page then), from the latest sample at or before it."""
    run, _c, _s = _run_or_404(run_id)
    samples = replay.sample_times(db(), run, store().blobs)
    at = time_arg("at")
    if at is None:  # now: a running run's latest sample, a finished run's last
        at = time.time()
    else:
        lo, hi = replay.time_range(run, samples)
        if not lo <= at <= hi:
            raise bad("at", f"outside the run: it ran from {lo} to {hi} (epoch seconds)")
    session = db().get(m.Session, run.session_id)
    return {
        "run": run.public_id,
        **replay.state_at(db(), run, at, _run_data(run), blobs=store().blobs),
        "thresholds": replay.thresholds(session.info if session is not None else None),
        "samples": samples,
    }


@bp.get("/v1/runs/<run_id>/activity")
def run_activity(run_id: str) -> Any:
    """Dask's fine performance metrics of the run, and totals by activity."""
    run, _c, _s = _run_or_404(run_id)
    return {"run": run.public_id, **activity.run_activity(db(), run.id)}


@bp.get("/v1/profiles")
def profiles_across_runs() -> Any:
    """The merged profile of a prefix (or of whole runs) over the runs in a window."""
    principal = require("read")
    prefix, name = label_arg("prefix", 1024), label_arg("name", 1024)
    if prefix is None and name is None:
        raise bad("prefix", "give a prefix, a job name (name=), or both")
    fmt = choice_arg("format", PROFILE_FORMATS) or "json"
    merged = profiles.across_runs(
        db(),
        principal.tenant_id,
        prefix=prefix,
        name=name,
        cluster=name_arg("cluster"),
        since=time_arg("since"),
        until=time_arg("until"),
        limit=int_arg("runs", profiles.MAX_RUNS, 1, profiles.MAX_RUNS),
        blobs=store().blobs,
    )
    label = " ".join(x for x in (name, prefix) if x)
    return _profile_answer(
        merged.profile,
        label,
        fmt,
        prefix=prefix,
        name=name,
        runs=merged.runs,
        truncated=merged.truncated,
    )


@bp.get("/v1/compare/profile")
def compare_profile() -> Any:
    """What is new in the hot path: run b's profile against run a's."""
    a, b = _two_runs()
    prefix = label_arg("prefix", 1024)
    fmt = choice_arg("format", ("json", "collapsed")) or "json"
    pa = profiles.load(db(), store().blobs, a, prefix=prefix)
    pb = profiles.load(db(), store().blobs, b, prefix=prefix)
    if fmt == "collapsed":
        return Response(flame.collapsed_diff(pa, pb), mimetype="text/plain")
    return {
        "a": a.public_id,
        "b": b.public_id,
        "prefix": prefix,
        "samples_a": pa.samples,
        "samples_b": pb.samples,
        "interval": pb.interval or pa.interval,
        "tree": flame.diff(pa, pb),
    }


@bp.get("/v1/history/activity")
def activity_history() -> Any:
    """Seconds (or bytes, counts) by activity per hour or day of run start, of a prefix
    and/or a job name, across the tenant's clusters."""
    principal = require("read")
    prefix, name = label_arg("prefix", 1024), label_arg("name", 1024)
    bucket = choice_arg("bucket", tuple(activity.BUCKETS)) or "day"
    unit = label_arg("unit", 64) or "seconds"
    points = activity.history(
        db(),
        principal.tenant_id,
        bucket=bucket,
        prefix=prefix,
        name=name,
        cluster=name_arg("cluster"),
        since=time_arg("since"),
        until=time_arg("until"),
        unit=unit,
    )
    return {"prefix": prefix, "name": name, "bucket": bucket, "unit": unit, "points": points}


# -- what the agents send besides tasks: logs, emitted values, workers (issue 9) ---------


def _extras(run: Any) -> runlogs.Extras:
    return runlogs.load(db(), store().blobs, run)


def _page_args(what: str) -> tuple[int, int]:
    """(offset, limit) of a page: ``limit`` and an opaque ``cursor`` from a previous page."""
    limit = int_arg("limit", 100, 1, runlogs.MAX_LIMIT)
    return _cursor_offset(what, f"not a cursor of {what}"), limit


@bp.get("/v1/runs/<run_id>/logs")
def run_logs(run_id: str) -> Any:
    """The run's log records, oldest first: filters ``level`` (and above), ``worker``
    (``scheduler`` for the scheduler's), ``since``/``until``, ``q`` (text); paged."""
    run, _c, _s = _run_or_404(run_id)
    level = label_arg("level", 32)
    filters = runlogs.LogFilters(
        level=level,
        worker=label_arg("worker", 1024),
        since=time_arg("since"),
        until=time_arg("until"),
        text=label_arg("q", 1024),
    )
    offset, limit = _page_args("logs")
    page = runlogs.log_page(_extras(run).logs, filters, offset, limit)
    end = page.pop("end")
    return {"run": run.public_id, **page, "next_cursor": _next_cursor("logs", end, page["total"])}


@bp.get("/v1/runs/<run_id>/streams")
def run_streams(run_id: str) -> Any:
    """The streams the run's tasks emitted values on (``hindsight.emit``), with counts."""
    run, _c, _s = _run_or_404(run_id)
    return {"run": run.public_id, "streams": runlogs.stream_names(_extras(run).streams)}


@bp.get("/v1/runs/<run_id>/streams/<path:stream>")
def run_stream(run_id: str, stream: str) -> Any:
    """One stream's values (time, worker, key, value), paged, and its numeric values
    aggregated per interval (``buckets`` over its span, or ``interval`` seconds)."""
    run, _c, _s = _run_or_404(run_id)
    if len(stream) > 256 or any(ord(ch) < 32 for ch in stream):
        raise bad("stream", "not a stream name")
    buckets = int_arg("buckets", 100, 1, 10_000)
    interval = float_arg("interval", 0.001, 86_400.0)
    offset, limit = _page_args(f"stream:{stream}")
    table = runlogs.one_stream(_extras(run).streams, stream)
    values = runlogs.stream_values(table, offset, limit)
    end = offset + len(values)
    return {
        "run": run.public_id,
        "stream": stream,
        "total": len(table),
        "values": values,
        "next_cursor": _next_cursor(f"stream:{stream}", end, len(table)),
        "aggregate": runlogs.aggregate(table, buckets, interval),
    }


@bp.get("/v1/runs/<run_id>/lifecycle")
def run_lifecycle(run_id: str) -> Any:
    """The session's facts and the workers present during the run: when each joined and
    left, why, and the run's tasks a departure took down."""
    run, _c, _s = _run_or_404(run_id)
    workers = runlogs.lifecycle(db(), store().blobs, run, lambda: _run_data(run).tasks)
    return {"run": run.public_id, "session": runlogs.session_facts(db(), run), "workers": workers}


@bp.get("/v1/runs/<run_id>/task-stream")
def run_task_stream(run_id: str) -> Any:
    """A window of the run's task stream at the detail ``width`` pixels can show."""
    run, _c, _s = _run_or_404(run_id)
    start, stop = time_arg("start"), time_arg("stop")
    width = int_arg("width", 1000, 1, task_stream.MAX_WIDTH)
    most = int_arg("max_rects", task_stream.MAX_RECTS, 0, task_stream.MAX_RECTS)
    try:
        found = task_stream.window(db(), store().blobs, run, start, stop, width, most)
    except task_stream.BadWindow as exc:
        raise bad("stop", str(exc)) from None
    body = msgspec.json.encode({"run": run.public_id, **found})
    return Response(body, mimetype="application/json")
