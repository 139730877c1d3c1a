"""The OpenAPI document's task-stream route (``GET /v1/runs/{run_id}/task-stream``)."""

from __future__ import annotations

from services.query.openapi_parts import NOT_FOUND, RUN_ID, get_op, query_param, time_param

_grid = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
_ints = {"type": "array", "items": {"type": "integer"}}

STREAM_PATHS = {
    "/v1/runs/{run_id}/task-stream": get_op(
        "A window of the run's task stream at the detail `width` pixels can show. `mode` "
        '"rects": every start/stop overlapping the window (at most `max_rects`), as columns: '
        "`lane` (an index of `lanes`), `key`, `prefix`, `action`, `start`, `stop` (epoch "
        'seconds), `erred`. `mode` "bins": `width` equal bins per lane between `bins.edges` '
        "(width + 1 epoch times); `bins.busy[lane][bin]` the seconds of start/stops in that "
        "bin (clipped to it: the bins add up to the window's seconds), `bins.prefix` the "
        "dominant category there (an index of `names`: the prefixes, then the actions other "
        "than compute; -1 idle), `bins.count` the start/stops counted at their midpoint's bin "
        "and `bins.prefix_count` those of the dominant category. A finished run answers from "
        "tiles built when it finished (a pyramid of busy seconds per lane, and its "
        "start/stops in time-ordered chunks), so any window answers in about the same time "
        "whatever the run's size",
        [
            RUN_ID,
            time_param("start", "the window's start (default: the run's first start)"),
            time_param("stop", "the window's end (default: the run's last stop)"),
            query_param(
                "width", {"type": "integer", "minimum": 1, "maximum": 4000}, "pixels (1000)"
            ),
            query_param(
                "max_rects",
                {"type": "integer", "minimum": 0, "maximum": 50000},
                "the most start/stops answered one by one (50,000)",
            ),
        ],
        {
            "type": "object",
            "required": ["mode", "start", "stop", "width", "lanes", "names"],
            "properties": {
                "run": {"type": "string"},
                "mode": {"type": "string", "enum": ["rects", "bins"]},
                "start": {"type": "number"},
                "stop": {"type": "number"},
                "width": {"type": "integer"},
                "origin": {"type": "number"},
                "count": {"type": "integer"},
                "lanes": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "worker": {"type": "string"},
                            "thread": {"type": ["integer", "null"]},
                        },
                    },
                },
                "names": {"type": "array", "items": {"type": "string"}},
                "rects": {
                    "type": "object",
                    "properties": {
                        "lane": _ints,
                        "key": {"type": "array", "items": {"type": "string"}},
                        "prefix": {"type": "array", "items": {"type": "string"}},
                        "action": {"type": "array", "items": {"type": "string"}},
                        "start": {"type": "array", "items": {"type": "number"}},
                        "stop": {"type": "array", "items": {"type": "number"}},
                        "erred": {"type": "array", "items": {"type": "boolean"}},
                    },
                },
                "bins": {
                    "type": "object",
                    "properties": {
                        "edges": {"type": "array", "items": {"type": "number"}},
                        "busy": _grid,
                        "prefix": _grid,
                        "count": _grid,
                        "prefix_count": _grid,
                    },
                },
                "source": {"type": "string"},
            },
        },
        NOT_FOUND,
    )
}
