"""The query service's OpenAPI document."""

from __future__ import annotations

from typing import Any

from services.common.openapi import document
from services.query.openapi_alerts import ALERT_PATHS
from services.query.openapi_lake import LAKE_PATHS
from services.query.openapi_parts import (
    ACTION,
    ARRAY,
    CURSOR,
    NOT_FOUND,
    OBJECT,
    RUN_ID,
    RUN_REF,
    STATS,
    TASK_FILTERS,
    TIME_PROPS,
    binary_op,
    get_op,
    limit_param,
    query_param,
    run_json_op,
    string_schema,
    time_param,
)
from services.query.openapi_stream import STREAM_PATHS

PATHS = {
    "/v1/clusters": get_op(
        "Clusters of the caller's tenant",
        [],
        {
            "type": "object",
            "properties": {"clusters": {"type": "array", "items": {"type": "object"}}},
        },
    ),
    "/v1/runs": get_op(
        "Runs with filters, sort and cursor pagination (newest first by default)",
        [
            {"name": "cluster", "in": "query", "schema": {"type": "string", "maxLength": 128}},
            {
                "name": "status",
                "in": "query",
                "schema": {"type": "string", "enum": ["running", "finished", "erred", "lost"]},
            },
            time_param("since", "runs started at or after"),
            time_param("until", "runs started before"),
            query_param(
                "name", string_schema(), "exact run name; a trailing * matches a name prefix"
            ),
            query_param(
                "min_duration", {"type": "number", "minimum": 0}, "makespan at least (seconds)"
            ),
            query_param(
                "has_errors",
                {"type": "boolean"},
                "only runs with (true) or without (false) erred tasks",
            ),
            query_param(
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
            limit_param(100, 1000),
            CURSOR,
        ],
        {
            "type": "object",
            "properties": {
                "runs": {"type": "array", "items": RUN_REF},
                "next_cursor": {"type": ["string", "null"]},
            },
        },
    ),
    "/v1/runs/{run_id}": get_op(
        "One run: status, times, counts, seconds by action, workers used, fingerprint, "
        "per-prefix rollups, completeness, finished-run work (compacted copy: pending or done)",
        [RUN_ID],
        RUN_REF,
        NOT_FOUND,
    ),
    "/v1/runs/{run_id}/tasks": get_op(
        "A run's task records (from its compacted copy), filtered, sorted, paginated",
        [RUN_ID, *TASK_FILTERS, limit_param(1000, 10000), CURSOR],
        {
            "type": "object",
            "properties": {
                "tasks": {"type": "array", "items": {"type": "object"}},
                "total": {"type": "integer"},
                "next_cursor": {"type": ["string", "null"]},
            },
        },
        NOT_FOUND,
    ),
    "/v1/runs/{run_id}/tasks/stream": binary_op(
        "Every matching task record as NDJSON (one JSON object per line), streamed",
        "application/x-ndjson",
        [RUN_ID, *TASK_FILTERS],
    ),
    "/v1/runs/{run_id}/tasks.parquet": binary_op(
        "The run's tasks as Parquet (the compacted copy: one row per task, seconds per action, "
        "startstops as JSON)",
        "application/vnd.apache.parquet",
        [
            RUN_ID,
            *TASK_FILTERS,
            query_param(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": 2**62},
                "at most this many rows (default: all)",
            ),
        ],
    ),
    "/v1/runs/{run_id}/summary": run_json_op(
        "Per prefix: count, errors, bytes and per action count/total/mean/min/p50/p90/p99/max "
        "(quantiles from mergeable histograms, within 4.5%)",
        {
            "prefixes": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "prefix": {"type": "string"},
                        "actions": {"type": "object", "additionalProperties": STATS},
                    },
                },
            }
        },
    ),
    "/v1/runs/{run_id}/metrics": get_op(
        "Worker metric series during the run, each downsampled to at most `points` points",
        [
            RUN_ID,
            query_param(
                "points", {"type": "integer", "minimum": 2, "maximum": 10000, "default": 500}
            ),
            query_param("worker", string_schema()),
            query_param("name", string_schema(256), "metric name, e.g. memory.managed"),
        ],
        {"type": "object", "properties": {"series": ARRAY}},
        NOT_FOUND,
    ),
    "/v1/runs/{run_id}/progress": get_op(
        "Completed tasks per prefix per time bucket",
        [
            RUN_ID,
            query_param(
                "buckets", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 50}
            ),
        ],
        {"type": "object", "properties": {"times": {"type": "array"}, "prefixes": OBJECT}},
        NOT_FOUND,
    ),
    "/v1/runs/{run_id}/graph": run_json_op(
        "The task graph: nodes with duration, worker, nbytes, typename, status; edges",
        {"nodes": ARRAY, "edges": ARRAY},
    ),
    "/v1/runs/{run_id}/errors": run_json_op(
        "Erred tasks grouped by exception text, numbers and hex ids set aside", {"groups": ARRAY}
    ),
    "/v1/runs/{run_id}/critical-path": run_json_op(
        "The chain of compute, transfer and waiting through the DAG that set the makespan",
        {"makespan": {"type": ["number", "null"]}, "segments": ARRAY, "totals": OBJECT},
    ),
    "/v1/runs/{run_id}/time": run_json_op(
        "Where the time went: compute / spill / other / idle worker-thread-seconds, and transfer "
        "seconds (on the event loop, beside the threads)",
        TIME_PROPS,
    ),
    "/v1/runs/{run_id}/regressions": get_op(
        "Prefixes whose p90 moved more than `threshold` % against the previous `baseline` runs "
        "with the same fingerprint",
        [
            RUN_ID,
            query_param(
                "baseline", {"type": "integer", "minimum": 1, "maximum": 100, "default": 5}
            ),
            query_param(
                "threshold", {"type": "number", "minimum": 0, "maximum": 10_000, "default": 20}
            ),
            ACTION,
            query_param(
                "same_cluster",
                {"type": "boolean", "default": False},
                "baselines from this run's cluster only (else any cluster's runs of the job)",
            ),
        ],
        {
            "type": "object",
            "properties": {"regressions": ARRAY, "baseline_runs": {"type": "array"}},
        },
        NOT_FOUND,
    ),
    "/v1/runs/{run_id}/explain": get_op(
        "Why the run was slower or faster than its job's usual runs (docs/explain.md): a "
        "verdict by statistics, findings ranked by seconds of makespan explained, a paragraph",
        [
            RUN_ID,
            query_param(
                "baseline", string_schema(64), "one run to compare with instead of the job's usual"
            ),
        ],
        {
            "type": "object",
            "properties": {
                "run": {"type": "string"},
                "verdict": {"enum": ["slower", "faster", "normal", "no history"]},
                "baseline": OBJECT,
                "makespan": {"type": ["number", "null"]},
                "change": {"type": ["number", "null"]},
                "findings": ARRAY,
                "text": {"type": "string"},
            },
        },
        NOT_FOUND,
    ),
    "/v1/runs/{run_id}/trace": get_op(
        "The run as Chrome trace-event JSON (Perfetto): a process per worker, a track per "
        "worker thread and transfer tracks, every phase (a slice that would overlap another "
        "on its track on a further lane of it)",
        [RUN_ID],
        {"type": "object", "properties": {"traceEvents": ARRAY}},
        NOT_FOUND,
    ),
    "/v1/compare": get_op(
        "Run b against run a: makespan, per-prefix count and duration deltas, new/missing prefixes",
        [
            query_param("a", string_schema(64)) | {"required": True},
            query_param("b", string_schema(64)) | {"required": True},
            ACTION,
        ],
        {
            "type": "object",
            "properties": {
                "makespan": OBJECT,
                "prefixes": ARRAY,
                "new_prefixes": {"type": "array"},
                "missing_prefixes": {"type": "array"},
            },
        },
        NOT_FOUND,
    ),
    "/v1/clusters/{cluster}/time": get_op(
        "Where the time went on a cluster over its runs started in the window",
        [
            {"name": "cluster", "in": "path", "required": True, "schema": string_schema(128)},
            time_param("since", "runs started at or after"),
            time_param("until", "runs started before"),
        ],
        {"type": "object", "properties": TIME_PROPS},
    ),
    "/v1/history/prefixes": get_op(
        "A prefix's duration quantiles per hour or day across the tenant's clusters"
        " (index rollups)",
        [
            query_param("prefix", string_schema()) | {"required": True},
            ACTION,
            query_param("bucket", {"type": "string", "enum": ["hour", "day"], "default": "hour"}),
            time_param("since", "from"),
            time_param("until", "to"),
            query_param("cluster", string_schema(128)),
        ],
        {"type": "object", "properties": {"points": ARRAY}},
    ),
    "/v1/history/clusters": get_op(
        "Per cluster per hour or day: runs, tasks, errors, compute/transfer/disk seconds",
        [
            query_param("bucket", {"type": "string", "enum": ["hour", "day"], "default": "hour"}),
            time_param("since", "from"),
            time_param("until", "to"),
            query_param("cluster", string_schema(128)),
        ],
        {"type": "object", "properties": {"points": ARRAY}},
    ),
}

# -- why a run was slow (issue 9): profiles and fine performance metrics
_profile_format = query_param(
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
    op = get_op(summary, [*params, _profile_format], _profile, *extra)
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
            RUN_ID,
            query_param("prefix", string_schema(), "only tasks of this prefix"),
            query_param("worker", string_schema(), "only this worker address"),
        ],
        NOT_FOUND,
    ),
    "/v1/runs/{run_id}/activity": run_json_op(
        "Dask's fine performance metrics of the run (its span's cumulative_worker_metrics, "
        "as of the last heartbeat after it ended), and totals by activity and unit. "
        "`coverage`: per prefix with at least 0.5 s of compute, the share of its task "
        "records' compute seconds the metrics hold as thread seconds; `partial` is true when "
        "one is below 0.85 (a worker left before its next heartbeat), null without metrics",
        {
            "activity": {"type": "array", "items": _metric},
            "totals": ARRAY,
            "as_of": {"type": ["number", "null"]},
            "coverage": {"type": "object", "additionalProperties": {"type": "number"}},
            "partial": {"type": ["boolean", "null"]},
        },
    ),
    "/v1/profiles": _profile_op(
        "The merged profile of a task prefix, or of a job's runs, over the runs started in a "
        "window (newest `runs` runs)",
        [
            query_param(
                "prefix",
                string_schema(),
                "the task prefix (without it: whole runs; then `name` is needed)",
            ),
            query_param("name", string_schema(), "only runs of this job name"),
            query_param("cluster", string_schema(128)),
            time_param("since", "runs started at or after"),
            time_param("until", "runs started before"),
            query_param(
                "runs",
                {"type": "integer", "minimum": 1, "maximum": 1000, "default": 1000},
                "at most this many runs, newest first",
            ),
        ],
    ),
    "/v1/compare/profile": get_op(
        "What changed in the hot path: run b's profile against run a's, frame by frame (samples "
        "and share of each run's samples); `format=collapsed` gives `stack A B` lines "
        "(flamegraph.pl's differential input)",
        [
            query_param("a", string_schema(64)) | {"required": True},
            query_param("b", string_schema(64)) | {"required": True},
            query_param("prefix", string_schema(), "one task prefix"),
            query_param(
                "format", {"type": "string", "enum": ["json", "collapsed"], "default": "json"}
            ),
        ],
        {
            "type": "object",
            "properties": {
                "samples_a": {"type": "integer"},
                "samples_b": {"type": "integer"},
                "tree": OBJECT,
            },
        },
        NOT_FOUND,
    ),
    "/v1/history/activity": get_op(
        "Fine performance metrics over time: per hour or day of run start, the runs and per "
        "activity the total and the mean per run (of a prefix, of a job name, or both)",
        [
            query_param("prefix", string_schema()),
            query_param("name", string_schema(), "job name"),
            query_param("bucket", {"type": "string", "enum": ["hour", "day"], "default": "day"}),
            query_param("unit", string_schema(64), "seconds (default), bytes or count"),
            time_param("since", "runs started at or after"),
            time_param("until", "runs started before"),
            query_param("cluster", string_schema(128)),
        ],
        {"type": "object", "properties": {"points": ARRAY}},
    ),
}
PATHS["/v1/compare/profile"]["get"]["responses"]["200"]["content"]["text/plain"] = {
    "schema": {"type": "string"}
}

_int = {"type": "integer"}
_num_or_null = {"type": ["number", "null"]}
PATHS["/v1/runs/{run_id}/state"] = get_op(
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
    [RUN_ID, time_param("at", "the moment (default: now), within the run")],
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
    NOT_FOUND,
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
                "worker_totals": OBJECT,
            },
        },
    },
}
_session_info = {
    "type": ["object", "null"],
    "properties": {
        "time": {"type": "number"},
        "address": _str_or_null,
        "versions": OBJECT,
        "config": OBJECT,
    },
}
_stream_name = {"name": "stream", "in": "path", "required": True, "schema": string_schema(256)}
PATHS |= {
    "/v1/runs/{run_id}/logs": get_op(
        "The run's log records (workers' and the scheduler's), oldest first: records its tasks "
        "logged, and records outside any task stamped within its time window",
        [
            RUN_ID,
            query_param(
                "level",
                string_schema(32),
                "this level and above (DEBUG, INFO, WARNING, ERROR, CRITICAL)",
            ),
            query_param("worker", string_schema(), "one worker's address, or `scheduler`"),
            time_param("since", "records at or after"),
            time_param("until", "records before"),
            query_param("q", string_schema(), "text in the message or logger name, any case"),
            limit_param(100, 1000),
            CURSOR,
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
        NOT_FOUND,
    ),
    "/v1/runs/{run_id}/streams": run_json_op(
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
    "/v1/runs/{run_id}/streams/{stream}": get_op(
        "One stream's values in time order (paged), and its numeric values aggregated per "
        "interval (count, sum, mean, min, max); a stream the run never emitted on has none",
        [
            RUN_ID,
            _stream_name,
            limit_param(100, 1000),
            CURSOR,
            query_param(
                "buckets",
                {"type": "integer", "minimum": 1, "maximum": 10000, "default": 100},
                "intervals over the stream's time span",
            ),
            query_param(
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
        NOT_FOUND,
    ),
    "/v1/runs/{run_id}/lifecycle": run_json_op(
        "The session's facts (versions, config excerpt, scheduler address) and the workers "
        "present during the run: joined, left, why, and the run's tasks a departure took down",
        {"session": _session_info, "workers": {"type": "array", "items": _lifecycle_worker}},
    ),
}


PATHS.update(LAKE_PATHS)
PATHS.update(ALERT_PATHS)
PATHS.update(STREAM_PATHS)

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
