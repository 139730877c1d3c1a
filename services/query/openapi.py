"""The query service's OpenAPI document."""

from __future__ import annotations

from typing import Any

from services.common.openapi import AUTH_ERRORS, UNAVAILABLE, document, error, ok

_limit = lambda default, hi: {  # noqa: E731
    "name": "limit",
    "in": "query",
    "schema": {"type": "integer", "minimum": 1, "maximum": hi, "default": default},
}
_cursor = {"name": "cursor", "in": "query", "schema": {"type": "string", "maxLength": 256}}
_time = lambda name, what: {  # noqa: E731
    "name": name,
    "in": "query",
    "description": f"{what}: epoch seconds or ISO 8601"
    + ("; a date alone (2026-11-21) includes that day (UTC)" if name == "until" else ""),
    "schema": {"type": "string", "maxLength": 256},
}
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
_q = lambda name, schema, desc=None: {  # noqa: E731
    "name": name,
    "in": "query",
    "schema": schema,
    **({"description": desc} if desc else {}),
}
_str = lambda n=1024: {"type": "string", "maxLength": n}  # noqa: E731
_obj = {"type": "object"}
_arr = {"type": "array", "items": _obj}
_task_filters = [
    _q("prefix", _str(), "tasks of this prefix"),
    _q("worker", _str(), "tasks that ran on this worker address"),
    _q("status", _str(32), "memory, erred, or lost (Ray: no end arrived)"),
    _time("since", "tasks that stopped at or after"),
    _time("until", "tasks that started before"),
    _q(
        "sort",
        {"type": "string", "enum": ["duration", "-duration", "start", "-start"]},
        "duration is compute seconds; '-' for descending",
    ),
]
_action = _q("action", _str(64), "compute (default), transfer, disk-read, disk-write")


def _json(summary: str, props: dict[str, Any]) -> dict[str, Any]:
    return _get(summary, [_run_id], {"type": "object", "properties": props}, _not_found)


_stats = {
    "type": "object",
    "properties": {
        k: {"type": ["number", "null"]}
        for k in ("count", "total", "mean", "min", "p50", "p90", "p99", "max")
    },
}
_time_props = {
    k: {"type": "number"} for k in ("capacity", "compute", "transfer", "spill", "other", "idle")
} | {"workers": _arr}


def _binary(summary: str, mime: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    op = _get(summary, params, _obj, _not_found)
    op["get"]["responses"]["200"]["content"] = {
        mime: {"schema": {"type": "string", "format": "binary"}}
    }
    return op


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
        "Runs with filters, sort and cursor pagination (newest first by default)",
        [
            {"name": "cluster", "in": "query", "schema": {"type": "string", "maxLength": 128}},
            {
                "name": "status",
                "in": "query",
                "schema": {"type": "string", "enum": ["running", "finished", "erred", "lost"]},
            },
            _time("since", "runs started at or after"),
            _time("until", "runs started before"),
            _q("name", _str(), "exact run name; a trailing * matches a name prefix"),
            _q("min_duration", {"type": "number", "minimum": 0}, "makespan at least (seconds)"),
            _q(
                "has_errors",
                {"type": "boolean"},
                "only runs with (true) or without (false) erred tasks",
            ),
            _q(
                "sort",
                {
                    "type": "string",
                    "enum": [
                        "-started_at",
                        "started_at",
                        "-makespan",
                        "makespan",
                        "-task_count",
                        "task_count",
                        "-error_count",
                        "error_count",
                    ],
                },
            ),
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
        "One run: status, times, counts, seconds by action, workers used, fingerprint, "
        "per-prefix rollups, completeness, finished-run work (compacted copy: pending or done)",
        [_run_id],
        _run,
        _not_found,
    ),
    "/v1/runs/{run_id}/tasks": _get(
        "A run's task records (from its compacted copy), filtered, sorted, paginated",
        [_run_id, *_task_filters, _limit(1000, 10000), _cursor],
        {
            "type": "object",
            "properties": {
                "tasks": {"type": "array", "items": {"type": "object"}},
                "total": {"type": "integer"},
                "next_cursor": {"type": ["string", "null"]},
            },
        },
        _not_found,
    ),
    "/v1/runs/{run_id}/tasks/stream": _binary(
        "Every matching task record as NDJSON (one JSON object per line), streamed",
        "application/x-ndjson",
        [_run_id, *_task_filters],
    ),
    "/v1/runs/{run_id}/tasks.parquet": _binary(
        "The run's tasks as Parquet (the compacted copy: one row per task, seconds per action, "
        "startstops as JSON)",
        "application/vnd.apache.parquet",
        [
            _run_id,
            *_task_filters,
            _q(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": 2**62},
                "at most this many rows (default: all)",
            ),
        ],
    ),
    "/v1/runs/{run_id}/summary": _json(
        "Per prefix: count, errors, bytes and per action count/total/mean/min/p50/p90/p99/max "
        "(quantiles from mergeable histograms, within 4.5%)",
        {
            "prefixes": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "prefix": {"type": "string"},
                        "actions": {"type": "object", "additionalProperties": _stats},
                    },
                },
            }
        },
    ),
    "/v1/runs/{run_id}/metrics": _get(
        "Worker metric series during the run, each downsampled to at most `points` points",
        [
            _run_id,
            _q("points", {"type": "integer", "minimum": 2, "maximum": 10000, "default": 500}),
            _q("worker", _str()),
            _q("name", _str(256), "metric name, e.g. memory.managed"),
        ],
        {"type": "object", "properties": {"series": _arr}},
        _not_found,
    ),
    "/v1/runs/{run_id}/progress": _get(
        "Completed tasks per prefix per time bucket",
        [_run_id, _q("buckets", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 50})],
        {"type": "object", "properties": {"times": {"type": "array"}, "prefixes": _obj}},
        _not_found,
    ),
    "/v1/runs/{run_id}/graph": _json(
        "The task graph: nodes with duration, worker, nbytes, typename, status; edges",
        {"nodes": _arr, "edges": _arr},
    ),
    "/v1/runs/{run_id}/errors": _json(
        "Erred tasks grouped by exception text, numbers and hex ids set aside", {"groups": _arr}
    ),
    "/v1/runs/{run_id}/critical-path": _json(
        "The chain of compute, transfer and waiting through the DAG that set the makespan",
        {"makespan": {"type": ["number", "null"]}, "segments": _arr, "totals": _obj},
    ),
    "/v1/runs/{run_id}/time": _json(
        "Where the time went: compute / spill / other / idle worker-thread-seconds, and transfer "
        "seconds (on the event loop, beside the threads)",
        _time_props,
    ),
    "/v1/runs/{run_id}/regressions": _get(
        "Prefixes whose p90 moved more than `threshold` % against the previous `baseline` runs "
        "with the same fingerprint",
        [
            _run_id,
            _q("baseline", {"type": "integer", "minimum": 1, "maximum": 100, "default": 5}),
            _q("threshold", {"type": "number", "minimum": 0, "maximum": 10_000, "default": 20}),
            _action,
            _q(
                "same_cluster",
                {"type": "boolean", "default": False},
                "baselines from this run's cluster only (else any cluster's runs of the job)",
            ),
        ],
        {"type": "object", "properties": {"regressions": _arr, "baseline_runs": {"type": "array"}}},
        _not_found,
    ),
    "/v1/runs/{run_id}/trace": _get(
        "The run as Chrome trace-event JSON (Perfetto): a process per worker, a track per "
        "worker thread and transfer tracks, every phase (a slice that would overlap another "
        "on its track on a further lane of it)",
        [_run_id],
        {"type": "object", "properties": {"traceEvents": _arr}},
        _not_found,
    ),
    "/v1/compare": _get(
        "Run b against run a: makespan, per-prefix count and duration deltas, new/missing prefixes",
        [_q("a", _str(64)) | {"required": True}, _q("b", _str(64)) | {"required": True}, _action],
        {
            "type": "object",
            "properties": {
                "makespan": _obj,
                "prefixes": _arr,
                "new_prefixes": {"type": "array"},
                "missing_prefixes": {"type": "array"},
            },
        },
        _not_found,
    ),
    "/v1/clusters/{cluster}/time": _get(
        "Where the time went on a cluster over its runs started in the window",
        [
            {"name": "cluster", "in": "path", "required": True, "schema": _str(128)},
            _time("since", "runs started at or after"),
            _time("until", "runs started before"),
        ],
        {"type": "object", "properties": _time_props},
    ),
    "/v1/history/prefixes": _get(
        "A prefix's duration quantiles per hour or day across the tenant's clusters"
        " (index rollups)",
        [
            _q("prefix", _str()) | {"required": True},
            _action,
            _q("bucket", {"type": "string", "enum": ["hour", "day"], "default": "hour"}),
            _time("since", "from"),
            _time("until", "to"),
            _q("cluster", _str(128)),
        ],
        {"type": "object", "properties": {"points": _arr}},
    ),
    "/v1/history/clusters": _get(
        "Per cluster per hour or day: runs, tasks, errors, compute/transfer/disk seconds",
        [
            _q("bucket", {"type": "string", "enum": ["hour", "day"], "default": "hour"}),
            _time("since", "from"),
            _time("until", "to"),
            _q("cluster", _str(128)),
        ],
        {"type": "object", "properties": {"points": _arr}},
    ),
}

# -- why a run was slow (issue 9): profiles and fine performance metrics
_profile_format = _q(
    "format",
    {"type": "string", "enum": ["json", "collapsed", "speedscope"], "default": "json"},
    "json: the call tree and the hottest functions; collapsed: folded stacks "
    "(`frame;frame;frame COUNT` a line, for flamegraph.pl, speedscope, inferno), as "
    "text/plain; speedscope: speedscope's JSON file format",
)
_frame_props = {
    "name": {"type": "string"},
    "filename": {"type": "string"},
    "first_line": {"type": "integer"},
    "line_number": {"type": "integer"},
    "line": {"type": "string"},
}
_tree = {
    "type": "object",
    "description": "a frame: samples with it on the stack (`samples`), of its own (`self`), "
    "and its callees (`children`, most sampled first); the root is `all`",
    "properties": {
        **_frame_props,
        "samples": {"type": "integer"},
        "self": {"type": "integer"},
        "children": {"type": "array", "items": {"type": "object"}},
    },
}
_profile = {
    "type": "object",
    "properties": {
        "samples": {"type": "integer"},
        "interval": {"type": "number", "description": "seconds per sample"},
        "seconds": {"type": "number"},
        "top": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    **_frame_props,
                    "self": {"type": "integer"},
                    "samples": {"type": "integer"},
                    "self_seconds": {"type": "number"},
                },
            },
        },
        "tree": _tree,
    },
}


def _profile_op(
    summary: str, params: list[dict[str, Any]], *extra: dict[str, Any]
) -> dict[str, Any]:
    op = _get(summary, [*params, _profile_format], _profile, *extra)
    op["get"]["responses"]["200"]["content"]["text/plain"] = {"schema": {"type": "string"}}
    return op


_metric = {
    "type": "object",
    "properties": {k: {"type": "string"} for k in ("context", "prefix", "activity", "unit")}
    | {"value": {"type": "number"}},
}
PATHS |= {
    "/v1/runs/{run_id}/profile": _profile_op(
        "The run's statistical profile (Dask's worker profiles, merged): call tree, hottest "
        "functions; of one task prefix and/or one worker",
        [
            _run_id,
            _q("prefix", _str(), "only tasks of this prefix"),
            _q("worker", _str(), "only this worker address"),
        ],
        _not_found,
    ),
    "/v1/runs/{run_id}/activity": _json(
        "Dask's fine performance metrics of the run (its span's cumulative_worker_metrics, "
        "as of the last heartbeat after it ended), and totals by activity and unit",
        {
            "activity": {"type": "array", "items": _metric},
            "totals": _arr,
            "as_of": {"type": ["number", "null"]},
        },
    ),
    "/v1/profiles": _profile_op(
        "The merged profile of a task prefix, or of a job's runs, over the runs started in a "
        "window (newest `runs` runs)",
        [
            _q("prefix", _str(), "the task prefix (without it: whole runs; then `name` is needed)"),
            _q("name", _str(), "only runs of this job name"),
            _q("cluster", _str(128)),
            _time("since", "runs started at or after"),
            _time("until", "runs started before"),
            _q(
                "runs",
                {"type": "integer", "minimum": 1, "maximum": 1000, "default": 1000},
                "at most this many runs, newest first",
            ),
        ],
    ),
    "/v1/compare/profile": _get(
        "What changed in the hot path: run b's profile against run a's, frame by frame (samples "
        "and share of each run's samples); `format=collapsed` gives `stack A B` lines "
        "(flamegraph.pl's differential input)",
        [
            _q("a", _str(64)) | {"required": True},
            _q("b", _str(64)) | {"required": True},
            _q("prefix", _str(), "one task prefix"),
            _q("format", {"type": "string", "enum": ["json", "collapsed"], "default": "json"}),
        ],
        {
            "type": "object",
            "properties": {
                "samples_a": {"type": "integer"},
                "samples_b": {"type": "integer"},
                "tree": _obj,
            },
        },
        _not_found,
    ),
    "/v1/history/activity": _get(
        "Fine performance metrics over time: per hour or day of run start, the runs and per "
        "activity the total and the mean per run (of a prefix, of a job name, or both)",
        [
            _q("prefix", _str()),
            _q("name", _str(), "job name"),
            _q("bucket", {"type": "string", "enum": ["hour", "day"], "default": "day"}),
            _q("unit", _str(64), "seconds (default), bytes or count"),
            _time("since", "runs started at or after"),
            _time("until", "runs started before"),
            _q("cluster", _str(128)),
        ],
        {"type": "object", "properties": {"points": _arr}},
    ),
}
PATHS["/v1/compare/profile"]["get"]["responses"]["200"]["content"]["text/plain"] = {
    "schema": {"type": "string"}
}

_int = {"type": "integer"}
_num_or_null = {"type": ["number", "null"]}
PATHS["/v1/runs/{run_id}/state"] = _get(
    "Replay: the run at a moment as Dask's status page showed it, from the latest state "
    "sample at or before `at` (the agent samples every sampling interval and at the run's "
    "end): bytes and tasks processing per worker, task states per prefix (waiting counts "
    "waiting, queued and no-worker; released counts released and forgotten). Tasks "
    "finished, processing and erred at `at` come from the run's task records where they "
    "exist (a sample is up to one interval old); memory and occupancy from the sample. "
    "Before the first sample every task not yet recorded is waiting. `thresholds` are the "
    "session's memory fractions (Dask colours managed memory orange from `target`); "
    "`samples` the run's sample range. An `at` outside the run (before its start, after "
    "its end and last sample) is a 400",
    [_run_id, _time("at", "the moment (default: now), within the run")],
    {
        "type": "object",
        "required": ["time", "workers", "prefixes"],
        "properties": {
            "run": {"type": "string"},
            "time": {"type": "number"},
            "sampled_at": _num_or_null,
            "workers": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "worker": {"type": "string"},
                        "processing": _int,
                        "memory": {
                            "type": "object",
                            "properties": {
                                k: _int for k in ("managed", "unmanaged", "spilled", "limit")
                            },
                        },
                    },
                },
            },
            "prefixes": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"prefix": {"type": "string"}}
                    | {k: _int for k in ("waiting", "processing", "memory", "released", "erred")},
                },
            },
            "thresholds": {
                "type": "object",
                "properties": {k: _num_or_null for k in ("target", "spill", "pause", "terminate")},
            },
            "samples": {
                "type": "object",
                "properties": {"first": _num_or_null, "last": _num_or_null, "samples": _int},
            },
        },
    },
    _not_found,
)


# ---------------------------------------------------------------- logs, streams, workers (issue 9)

_str_or_null = {"type": ["string", "null"]}
_page = lambda what: {  # noqa: E731
    "total": {"type": "integer", "description": f"{what} matching"},
    "next_cursor": {**_str_or_null, "description": "pass as `cursor` for the next page"},
}
_log = {
    "type": "object",
    "properties": {
        "time": {"type": "number"},
        "level": {"type": "string"},
        "worker": {**_str_or_null, "description": "worker address, or `scheduler`"},
        "logger": {"type": "string"},
        "message": {"type": "string"},
        "key": {"type": "string", "description": "the task that logged it, if one did"},
    },
}
_stream_value = {
    "type": "object",
    "properties": {
        "time": {"type": "number"},
        "worker": _str_or_null,
        "key": _str_or_null,
        "value": {"description": "the value as emitted (any JSON)"},
    },
}
_point = {
    "type": "object",
    "properties": {k: {"type": "number"} for k in ("time", "count", "sum", "mean", "min", "max")},
}
_took = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "key": {"type": "string"},
            "worker": _str_or_null,
            "status": _str_or_null,
            "stop": _num_or_null,
        },
    },
}
_lifecycle_worker = {
    "type": "object",
    "properties": {
        "address": {"type": "string"},
        "name": _str_or_null,
        "nthreads": {"type": ["integer", "null"]},
        "memory_limit": {"type": ["integer", "null"]},
        "joined_at": _num_or_null,
        "left_at": _num_or_null,
        "joined_during_run": {"type": "boolean"},
        "left_during_run": {"type": "boolean"},
        "reason": {**_str_or_null, "description": "the scheduler's stimulus for removing it"},
        "cause": {
            "type": "string",
            "enum": ["retired", "closed", "lost", "timed-out", "removed", "unknown"],
        },
        "cause_text": {"type": "string"},
        "expected": {"type": ["boolean", "null"]},
        "last_status": _str_or_null,
        "took_down": {
            "type": "object",
            "description": "the run's tasks its leaving took down",
            "properties": {
                "erred": {"type": "array", "items": {"type": "string"}},
                "rescheduled": _took,
                "recomputed": _took,
                "lost": {"type": "array", "items": {"type": "string"}},
                "worker_totals": _obj,
            },
        },
    },
}
_session_info = {
    "type": ["object", "null"],
    "properties": {
        "time": {"type": "number"},
        "address": _str_or_null,
        "versions": _obj,
        "config": _obj,
    },
}
_stream_name = {"name": "stream", "in": "path", "required": True, "schema": _str(256)}
PATHS |= {
    "/v1/runs/{run_id}/logs": _get(
        "The run's log records (workers' and the scheduler's), oldest first: records its tasks "
        "logged, and records outside any task stamped within its time window",
        [
            _run_id,
            _q("level", _str(32), "this level and above (DEBUG, INFO, WARNING, ERROR, CRITICAL)"),
            _q("worker", _str(), "one worker's address, or `scheduler`"),
            _time("since", "records at or after"),
            _time("until", "records before"),
            _q("q", _str(), "text in the message or logger name, any case"),
            _limit(100, 1000),
            _cursor,
        ],
        {
            "type": "object",
            "properties": {
                "logs": {"type": "array", "items": _log},
                **_page("records"),
                "levels": {
                    "type": "object",
                    "description": "the run's records per level (unfiltered)",
                },
            },
        },
        _not_found,
    ),
    "/v1/runs/{run_id}/streams": _json(
        "The streams the run's tasks emitted values on (`hindsight.emit`): values, numeric "
        "values, workers, first and last times",
        {
            "streams": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "stream": {"type": "string"},
                        "count": {"type": "integer"},
                        "numeric": {"type": "integer"},
                        "first": {"type": "number"},
                        "last": {"type": "number"},
                        "workers": {"type": "integer"},
                    },
                },
            }
        },
    ),
    "/v1/runs/{run_id}/streams/{stream}": _get(
        "One stream's values in time order (paged), and its numeric values aggregated per "
        "interval (count, sum, mean, min, max); a stream the run never emitted on has none",
        [
            _run_id,
            _stream_name,
            _limit(100, 1000),
            _cursor,
            _q(
                "buckets",
                {"type": "integer", "minimum": 1, "maximum": 10000, "default": 100},
                "intervals over the stream's time span",
            ),
            _q(
                "interval",
                {"type": "number", "minimum": 0.001, "maximum": 86400},
                "interval in seconds instead (widened to answer at most 10,000 points)",
            ),
        ],
        {
            "type": "object",
            "properties": {
                "stream": {"type": "string"},
                "values": {"type": "array", "items": _stream_value},
                **_page("values"),
                "aggregate": {
                    "type": ["object", "null"],
                    "properties": {
                        "interval": {"type": "number"},
                        "start": {"type": "number"},
                        "points": {"type": "array", "items": _point},
                    },
                },
            },
        },
        _not_found,
    ),
    "/v1/runs/{run_id}/lifecycle": _json(
        "The session's facts (versions, config excerpt, scheduler address) and the workers "
        "present during the run: joined, left, why, and the run's tasks a departure took down",
        {"session": _session_info, "workers": {"type": "array", "items": _lifecycle_worker}},
    ),
}


# ---------------------------------------------------------------- the history lake (docs/lake.md)

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
_number = lambda name, desc: _q(name, {"type": "number"}, desc)  # noqa: E731
_lake_filters = [
    _many("cluster", "partitions of these clusters", 128),
    _time("since", "rows overlapping the window from (tasks: stopped at or after)"),
    _time("until", "rows overlapping the window to (tasks: started before)"),
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
    _q("columns", _str(2048), "comma-separated columns (default: all, with cluster and day)"),
]
_lake_rows = _get(
    "Rows of a lake table across runs and clusters: filters, columns, sort, limit. JSON (at "
    "most 10,000 rows) or, with format=arrow|parquet, streamed Arrow IPC / Parquet of any size",
    [
        _lake_table,
        *_lake_filters,
        _q("sort", _str(64), "a column, '-' for descending"),
        {
            "name": "limit",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1},
            "description": "JSON: 1,000 by default, at most 10,000; sorted Arrow/Parquet: "
            "at most 1,000,000; unsorted Arrow/Parquet: every row by default",
        },
        _q("format", {"type": "string", "enum": ["json", "arrow", "parquet"]}),
    ],
    {
        "type": "object",
        "properties": {
            "table": {"type": "string"},
            "rows": _arr,
            "count": {"type": "integer"},
            "truncated": {"type": "boolean"},
            "scan": _obj,
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
_lake_file = _binary(
    "One planned lake file's rows matching the filters, as Arrow IPC (a Dask partition's read)",
    "application/vnd.apache.arrow.stream",
    [
        _lake_table,
        {"name": "cluster", "in": "path", "required": True, "schema": _str(128)},
        {"name": "day", "in": "path", "required": True, "schema": _str(10)},
        {"name": "name", "in": "path", "required": True, "schema": _str(64)},
        *_lake_filters,
    ],
)
_lake_file["get"]["responses"]["404"] = error("no such lake file (or table)")
PATHS.update(
    {
        "/v1/lake/{table}": _lake_rows,
        "/v1/lake/{table}/files": _get(
            "The plan of a lake scan: the files its filters keep (partition and statistics "
            "pruning), each with its rows, bytes, and where to read it",
            [_lake_table, *_lake_filters],
            {
                "type": "object",
                "properties": {
                    "table": {"type": "string"},
                    "columns": {"type": "array"},
                    "schema": {"type": "string", "description": "Arrow IPC schema, base64"},
                    "files": _arr,
                },
            },
            {"404": error("no such lake table")},
        ),
        "/v1/lake/{table}/files/{cluster}/{day}/{name}": _lake_file,
    }
)

RUN = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "name": {"type": ["string", "null"]},
        "cluster": {"type": "string"},
        "session": {"type": "string"},
        "status": {"type": "string", "enum": ["running", "finished", "erred", "lost"]},
        "started_at": {"type": ["number", "null"]},
        "finished_at": {"type": ["number", "null"]},
        "makespan": {"type": ["number", "null"]},
        "task_count": {"type": "integer"},
        "error_count": {"type": "integer"},
        "session_info": {
            "type": ["object", "null"],
            "description": "the session's facts: versions, config excerpt, scheduler address",
        },
    },
}

OPENAPI = document("Hindsight query service", PATHS, {"Run": RUN})
