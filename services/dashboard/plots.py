"""Bokeh figures built from recorded runs, in Dask's visual conventions.

Colours follow ``distributed.diagnostics.task_stream``: a colour per task prefix (md5 of the
prefix into an 18-colour viridis palette), transfers red, disk reads and writes orange,
failed computations black.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from itertools import chain
from typing import Any

import msgspec
import numpy as np
from bokeh.embed import json_item
from bokeh.models import ColumnDataSource, HoverTool, NumeralTickFormatter
from bokeh.plotting import figure

# distributed.utils.palette (viridis, 18 colours)
PALETTE = (
    "#440154",
    "#471669",
    "#472A79",
    "#433C84",
    "#3C4D8A",
    "#355D8C",
    "#2E6C8E",
    "#287A8E",
    "#23898D",
    "#1E978A",
    "#20A585",
    "#2EB27C",
    "#45BF6F",
    "#64CB5D",
    "#88D547",
    "#AFDC2E",
    "#D7E219",
    "#FDE724",
)
ACTION_COLOURS = {
    "transfer": ("red", 0.4),
    "disk-read": ("orange", 0.4),
    "disk-write": ("orange", 0.4),
}


@functools.lru_cache(maxsize=4096)
def colour_of(prefix: str) -> str:
    """Dask's colour for a task prefix (``distributed.diagnostics.progress_stream.color_of``)."""
    n = int(hashlib.md5(prefix.encode()).hexdigest()[:8], 16)
    return PALETTE[n % len(PALETTE)]


class _Phase(msgspec.Struct, gc=False):
    action: str
    start: float
    stop: float


_phases = msgspec.json.Decoder(list[list[_Phase]])


@functools.cache
def warm_up() -> None:
    """Build and serialise a small run page's figures once (Bokeh fills its per-class
    property caches on first use)."""
    from bokeh.layouts import column
    from bokeh.models import DataRange1d

    x_range = DataRange1d()
    stream, _ = _stream_figure("warm-up", ["row"], x_range, name="warm-up", source_name="warm-up")
    line = _time_figure("warm-up", x_range)
    line.line(x=[0, 1], y=[0, 1])
    json_item(column(stream, line, sizing_mode="stretch_width"), "warm-up")


def task_stream_data(table: Any, *, keys: bool = True) -> tuple[dict[str, Any], list[str], float]:
    """A run's task stream, compactly: one rectangle per startstop as typed arrays (base64),
    with task keys, labels and colours sent once and referenced by index. The page expands
    it (``expandStream``) into the columns the figure's source wants. Returns the payload,
    the worker-thread rows, and the time origin.

    Compute phases come straight from the compacted table's columns (vectorised); only
    tasks that also transferred or touched disk have their startstops parsed."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = table.select(
        [
            "key",
            "prefix",
            "worker",
            "thread",
            "status",
            "compute_start",
            "compute_stop",
            "transfer",
            "disk_read",
            "disk_write",
            "startstops",
        ]
    )
    # A row per worker thread ("worker-thread"); per worker process where the scheduler
    # reports no threads (Ray).
    worker = pc.fill_null(t["worker"], "?")
    row_names = pc.if_else(
        pc.is_null(t["thread"]),
        worker,
        pc.binary_join_element_wise(worker, pc.cast(t["thread"], pa.string()), "-"),
    )
    # Names, colours and rows per distinct prefix and row, not per task: a 100,000-task run
    # has a handful of prefixes and a few dozen worker threads.
    prefix_codes = pc.dictionary_encode(t["prefix"]).combine_chunks()
    prefix_of = prefix_codes.dictionary.to_pylist()
    prefix_idx = np.asarray(pc.fill_null(prefix_codes.indices, 0), dtype="i4")
    erred = np.asarray(pc.fill_null(pc.equal(t["status"], "erred"), False), dtype=bool)
    cstart = np.asarray(pc.fill_null(t["compute_start"], np.nan), dtype="f8")
    cstop = np.asarray(pc.fill_null(t["compute_stop"], np.nan), dtype="f8")
    extra = np.flatnonzero(
        np.asarray(pc.fill_null(t["transfer"], 0), dtype="f8")
        + np.asarray(pc.fill_null(t["disk_read"], 0), dtype="f8")
        + np.asarray(pc.fill_null(t["disk_write"], 0), dtype="f8")
        > 0
    )
    extra_ss = pc.take(t["startstops"], pa.array(extra, type=pa.int64())).to_pylist()
    extra_phases = _phases.decode(("[" + ",".join(s or "[]" for s in extra_ss) + "]").encode())
    has_compute = ~np.isnan(cstart)

    # labels and colours: compute phases are labelled by prefix, the rest "action prefix"
    names: dict[str, int] = {}
    colours: dict[tuple[str, float], int] = {}
    name_of = np.asarray([names.setdefault(p, len(names)) for p in prefix_of], dtype="i4")
    colour_of_prefix = [colours.setdefault((colour_of(p), 1.0), len(colours)) for p in prefix_of]
    prefix_name = name_of[prefix_idx]
    prefix_colour = np.asarray(colour_of_prefix, dtype="i4")[prefix_idx]
    black = colours.setdefault(("black", 1.0), len(colours))
    compute_c = np.where(erred, black, prefix_colour)

    # Every non-compute phase of those tasks, as arrays: a Python loop over a 100k-task
    # run's ~30,000 transfers took ~40 ms of the page.
    counts = np.fromiter(map(len, extra_phases), dtype=np.int64, count=len(extra_phases))
    flat = list(chain.from_iterable(extra_phases))
    keep = np.fromiter((ph.action != "compute" for ph in flat), dtype=bool, count=len(flat))
    kept = [ph.action for ph in flat if ph.action != "compute"]
    ex_task = np.repeat(extra, counts)[keep]
    ex_start = np.fromiter((ph.start for ph in flat), dtype="f8", count=len(flat))[keep]
    ex_stop = np.fromiter((ph.stop for ph in flat), dtype="f8", count=len(flat))[keep]
    action_of = list(dict.fromkeys(kept))
    code = {a: i for i, a in enumerate(action_of)}
    ex_action = np.fromiter(map(code.__getitem__, kept), dtype="i8", count=len(kept))
    action_c = np.asarray(
        [colours.setdefault(ACTION_COLOURS.get(a, ("gray", 0.4)), len(colours)) for a in action_of],
        dtype="i4",
    )
    ex_c = action_c[ex_action] if len(ex_task) else np.zeros(0, dtype="i4")
    # labels "action prefix", one per distinct pair
    n_prefix = max(len(prefix_of), 1)
    pairs, pair_idx = np.unique(ex_action * n_prefix + prefix_idx[ex_task], return_inverse=True)
    pair_name = np.asarray(
        [
            names.setdefault(f"{action_of[q // n_prefix]} {prefix_of[q % n_prefix]}", len(names))
            for q in pairs.tolist()
        ],
        dtype="i4",
    )
    ex_n = pair_name[pair_idx] if len(ex_task) else np.zeros(0, dtype="i4")
    ex_x = (ex_start + ex_stop) / 2
    ex_w = ex_stop - ex_start
    origin = float(np.nanmin(cstart)) if has_compute.any() else np.inf
    if len(ex_start):
        origin = min(origin, float(ex_start.min()))
    if not np.isfinite(origin):
        origin = 0.0

    tasks_c = np.flatnonzero(has_compute)
    task_idx = np.concatenate([tasks_c, np.asarray(ex_task, dtype="i8")]).astype("i4")
    x = (
        np.concatenate([(cstart[tasks_c] + cstop[tasks_c]) / 2, np.asarray(ex_x, dtype="f8")])
        - origin
    )
    width = np.concatenate([cstop[tasks_c] - cstart[tasks_c], np.asarray(ex_w, dtype="f8")])
    c = np.concatenate([compute_c[tasks_c], np.asarray(ex_c, dtype="i4")]).astype("i4")
    n = np.concatenate([prefix_name[tasks_c], np.asarray(ex_n, dtype="i4")]).astype("i4")

    row_codes = pc.dictionary_encode(row_names).combine_chunks()
    row_idx = np.asarray(row_codes.indices, dtype="i4")
    row_of_code = row_codes.dictionary.to_pylist()
    drawn = np.unique(row_idx[task_idx])  # the codes of rows with a rectangle
    rows = sorted(row_of_code[i] for i in drawn.tolist())
    order = {r: i for i, r in enumerate(rows)}
    code_row = np.asarray([order.get(r, -1) for r in row_of_code], dtype="i4")
    y = code_row[row_idx[task_idx]] if len(task_idx) else np.zeros(0, dtype="i4")

    def b64(values: Any, dtype: str) -> str:
        return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode()

    payload = {
        "count": int(len(x)),
        "x": b64(x, "<f8"),
        "width": b64(width, "<f8"),
        "y": b64(y, "<i4"),
        "c": b64(c, "<i4"),
        "k": b64(task_idx, "<i4"),
        "n": b64(n, "<i4"),
        "names": list(names),
        "colours": [list(ca) for ca in colours],
    }
    if keys:
        payload["keys"] = stream_keys(table)
    else:  # the page requests them (``stream_keys``) while it builds its figures
        payload["tasks"] = table.num_rows
    return payload, rows, origin


def wrapping_tooltips(rows: list[tuple[str, str]]) -> str:
    """A hover's rows (label, Bokeh field template) as Bokeh lays them out, but wrapping a
    value wider than the tooltip may be: Bokeh's own rows never wrap, and a task key longer
    than the screen (a tuple holding a path or a token) ran off the page. Bokeh escapes the
    fields' values in an HTML template as it does in its own rows."""
    row = (
        '<div style="display:table-row">'
        '<div class="bk-tooltip-row-label" style="display:table-cell;padding-right:0.5em;'
        'white-space:nowrap">{}: </div>'
        '<div class="bk-tooltip-row-value" style="display:table-cell;overflow-wrap:anywhere">'
        "{}</div></div>"
    )
    cells = "".join(row.format(label, field) for label, field in rows)
    return f'<div style="display:table;max-width:min(40em,45vw);white-space:normal">{cells}</div>'


def stream_keys(table: Any) -> list[str]:
    """The task keys :func:`task_stream_data`'s ``k`` indices refer to (the table's rows)."""
    return table.column("key").to_pylist()


STREAM_HEIGHT = 0.85  # of a row; hindsight.js paints the same


def _stream_figure(
    title: str, rows: list[str], x_range: Any, *, name: str, source_name: str
) -> tuple[Any, Any]:
    """A task-stream figure with empty sources: the page fills ``source.data`` from plain
    arrays after embedding (Bokeh's per-element serialisation of 100k-row columns took
    seconds in Python and more in the browser), and its painted copy, ``painted-NAME``: an
    image of them at the screen's resolution (``rasterise`` in hindsight.js). The per-task
    rectangles are drawn by nothing; they answer the hover."""
    from bokeh.models import FixedTicker, Range1d

    empty = {k: [] for k in ("x", "width", "y", "colour", "alpha", "key", "name")}
    source = ColumnDataSource(empty, name=source_name)
    paint = ColumnDataSource(
        {"image": [], "x": [], "y": [], "dw": [], "dh": []}, name=f"painted-{source_name}"
    )
    fig = figure(
        title=title,
        x_range=x_range,
        y_range=Range1d(len(rows) - 0.5, -0.5),
        height=max(160, 24 * len(rows) + 80),
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        active_scroll="xwheel_zoom",
        output_backend="canvas",
        name=name,
    )
    fig.image_rgba(image="image", x="x", y="y", dw="dw", dh="dh", source=paint)
    tasks = fig.rect(
        x="x",
        y="y",
        width="width",
        height=STREAM_HEIGHT,
        source=source,
        fill_color=None,
        line_color=None,
    )
    fig.add_tools(
        HoverTool(
            renderers=[tasks],
            tooltips=wrapping_tooltips(
                [("task", "@name"), ("key", "@key"), ("seconds", "@width{0.000}")]
            ),
        )
    )
    fig.yaxis.ticker = FixedTicker(ticks=list(range(len(rows))), name=f"{name}-rows")
    fig.yaxis.major_label_overrides = {i: r for i, r in enumerate(rows)}
    fig.yaxis.major_label_text_font_size = "8pt"
    fig.ygrid.visible = False
    fig.toolbar.logo = None
    return fig, source


# ------------------------------------------------------------------ the whole run page

DAG_MAX_NODES = 5000
WORKER_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
)
MEMORY_KINDS = (
    ("memory.managed", "managed"),
    ("memory.unmanaged", "unmanaged"),
    ("memory.spilled", "spilled"),
)


#: Bytes on the memory axes and hovers: 1.5 GiB, not Bokeh's 1.5e+9.
BYTES = "0.[0] ib"


def _time_figure(title: str, x_range: Any, height: int = 180, **kw: Any) -> Any:
    fig = figure(
        title=title,
        x_range=x_range,
        height=height,
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        active_scroll="xwheel_zoom",
        **kw,
    )
    fig.toolbar.logo = None
    return fig


def _series_lines(
    fig: Any,
    series: list[dict[str, Any]],
    origin: float,
    colours: dict[str, str],
    label: Any,
    name: str,
    number: str = "0.[00]a",
) -> int:
    """One multi-line renderer, a line per series (x: seconds since origin), the series'
    label on hover; returns how many lines were drawn. (A renderer per line cost ~25 ms
    each to build and serialise: 80 of them on a 16-worker run.)"""
    drawn = [s for s in series if s["points"]]
    if not drawn:
        return 0
    src = ColumnDataSource(
        {
            "xs": [[p["time"] - origin for p in s["points"]] for s in drawn],
            "ys": [[p["value"] for p in s["points"]] for s in drawn],
            "colour": [colours.get(s["worker"], "#555") for s in drawn],
            "label": [label(s) for s in drawn],
        },
        name=name,
    )
    fig.multi_line("xs", "ys", source=src, line_color="colour", line_width=1.5)
    fig.add_tools(
        HoverTool(tooltips=[("", "@label"), ("value", f"$y{{{number}}}")], line_policy="nearest")
    )
    return len(drawn)


def run_page_items(
    data: Any,
    critical: dict[str, Any],
    progress: dict[str, Any],
    metrics: list[dict[str, Any]],
    *,
    inline_keys: bool = False,
) -> dict[str, Any]:
    """Every plot of a run page as Bokeh JSON items: the time plots share one x axis. The
    task stream's keys (the hover's) are left out unless ``inline_keys`` (a running run,
    whose tasks change between requests)."""
    from bokeh.layouts import column
    from bokeh.models import DataRange1d

    # Without the task keys (the hover's; half of a 100k-task run's page): the page fetches
    # them from /runs/<id>/stream-keys while it builds its figures.
    cols, rows, origin = task_stream_data(data.tasks, keys=inline_keys)
    x_range = DataRange1d(name="run-time")
    stream, _ = _stream_figure(
        "Task stream", rows, x_range, name="task-stream", source_name="task-stream-source"
    )

    # Replay's cursor (services/dashboard/static/replay.js moves it to the slider's time)
    from bokeh.models import Span

    stream.add_layout(
        Span(
            location=0,
            dimension="height",
            line_color="#d62728",
            line_width=2,
            visible=False,
            name="replay-cursor",
        )
    )
    figs = [stream]
    # Progress: completed tasks per prefix over time (cumulative), Dask's prefix colours.
    prog = _time_figure("Progress by prefix (tasks completed)", x_range, height=200)
    prog.name = "progress"
    n_prog = 0
    if progress.get("times"):
        xs = [t - origin for t in progress["times"]]
        series = []
        for prefix, counts in sorted(progress["prefixes"].items()):
            total, ys = 0, []
            for c in counts:
                total += c
                ys.append(total)
            series.append(
                {
                    "worker": prefix,
                    "points": [
                        {"time": x + origin, "value": y} for x, y in zip(xs, ys, strict=True)
                    ],
                }
            )
        n_prog = _series_lines(
            prog,
            series,
            origin,
            {p: colour_of(p) for p in progress["prefixes"]},
            lambda s: s["worker"],
            "progress",
        )
        figs.append(prog)

    workers = sorted({s["worker"] for s in metrics if s["worker"] != "scheduler"})
    colours = {w: WORKER_PALETTE[i % len(WORKER_PALETTE)] for i, w in enumerate(workers)}
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in metrics:
        if s["worker"] != "scheduler":
            by_name.setdefault(s["name"], []).append(s)
    counts = {}
    for metric, label in MEMORY_KINDS:
        fig = _time_figure(f"Memory: {label} bytes per worker", x_range)
        fig.name = f"memory-{label}"
        # bytes as 1.5 GiB, not 1.5e+9 (Bokeh's default ticks for large numbers)
        fig.yaxis.formatter = NumeralTickFormatter(format=BYTES)
        counts[f"memory-{label}"] = _series_lines(
            fig,
            by_name.get(metric, []),
            origin,
            colours,
            lambda s: s["worker"],
            f"memory-{label}",
            BYTES,
        )
        if counts[f"memory-{label}"]:
            figs.append(fig)
    for metric, title, key in (
        ("cpu", "CPU % per worker", "cpu"),
        ("tasks.processing", "Tasks processing per worker", "tasks"),
    ):
        fig = _time_figure(title, x_range)
        fig.name = key
        counts[key] = _series_lines(
            fig, by_name.get(metric, []), origin, colours, lambda s: s["worker"], key
        )
        if counts[key]:  # no empty panel: a run without worker metrics (Ray), a metric
            figs.append(fig)  # no sample of the run has (an empty one also logged a warning)
    for f in figs[1:]:
        f.xaxis.axis_label = None
    figs[-1].xaxis.axis_label = "seconds since the run's first task"

    dag, dag_nodes = dag_item(data, critical)
    return {
        "timeline": json_item(column(*figs, sizing_mode="stretch_width"), "timeline"),
        "stream": cols,
        "origin": origin,
        "dag": dag,
        "counts": {
            "glyphs": len(cols["x"]),
            "rows": len(rows),
            "progress": n_prog,
            "dag_nodes": dag_nodes,
            **counts,
        },
    }


def _ramp(values: list[float | None]) -> list[str]:
    """Viridis colours for numbers (log scale); grey for missing."""
    import math

    logs = [math.log10(v) if v and v > 0 else None for v in values]
    present = [v for v in logs if v is not None]
    if not present:
        return ["#cccccc"] * len(values)
    lo, hi = min(present), max(present)
    span = (hi - lo) or 1.0
    return [
        "#cccccc" if v is None else PALETTE[min(17, int((v - lo) / span * 17.999))] for v in logs
    ]


def _categories(values: list[Any]) -> list[str]:
    index: dict[Any, int] = {}
    return [WORKER_PALETTE[index.setdefault(v, len(index)) % len(WORKER_PALETTE)] for v in values]


def dag_item(data: Any, critical: dict[str, Any]) -> tuple[dict[str, Any] | None, int]:
    """The task graph laid out by depth (longest chain from a root), coloured by an attribute
    picked from a dropdown (as the Dask Log Server prototype did); the critical path in red."""
    from bokeh.layouts import column
    from bokeh.models import CustomJS, Select

    if data.tasks.num_rows > DAG_MAX_NODES or data.graph.num_rows > DAG_MAX_NODES:
        return None, max(data.tasks.num_rows, data.graph.num_rows)
    graph = data.graph.to_pylist()
    attrs = {
        r["key"]: r
        for r in data.tasks.select(
            ["key", "prefix", "worker", "nbytes", "typename", "compute"]
        ).to_pylist()
    }
    deps = {r["key"]: [d for d in r["dependencies"]] for r in graph}
    for key in attrs:
        deps.setdefault(key, [])
    if not deps or len(deps) > DAG_MAX_NODES:
        return None, len(deps)
    depth: dict[str, int] = {}
    for key in deps:  # iterative longest-path depth
        stack = [key]
        while stack:
            k = stack[-1]
            if k in depth:
                stack.pop()
                continue
            pending = [d for d in deps.get(k, ()) if d in deps and d not in depth]
            if pending:
                stack.extend(pending)
                continue
            depth[k] = 1 + max((depth[d] for d in deps.get(k, ()) if d in depth), default=-1)
            stack.pop()
    levels: dict[int, list[str]] = {}
    for k in sorted(deps, key=lambda k: (depth[k], attrs.get(k, {}).get("prefix") or "", k)):
        levels.setdefault(depth[k], []).append(k)
    pos = {}
    for lvl, keys in levels.items():
        for i, k in enumerate(keys):
            pos[k] = (lvl, i - (len(keys) - 1) / 2)
    keys = list(pos)
    on_path = {s["key"] for s in critical.get("segments", ())}
    a = [attrs.get(k, {}) for k in keys]
    node_cols = {
        "x": [pos[k][0] for k in keys],
        "y": [pos[k][1] for k in keys],
        "key": keys,
        "prefix": [x.get("prefix") or "" for x in a],
        "worker": [x.get("worker") or "" for x in a],
        "duration": [x.get("compute") for x in a],
        "nbytes": [x.get("nbytes") for x in a],
        "typename": [x.get("typename") or "" for x in a],
        "line": ["red" if k in on_path else None for k in keys],
        "c_prefix": [colour_of(x.get("prefix") or "") for x in a],
        "c_duration": _ramp([x.get("compute") for x in a]),
        "c_worker": _categories([x.get("worker") for x in a]),
        "c_nbytes": _ramp([x.get("nbytes") for x in a]),
        "c_typename": _categories([x.get("typename") for x in a]),
    }
    node_cols["colour"] = list(node_cols["c_prefix"])
    edges: dict[str, list[Any]] = {
        "x0": [],
        "y0": [],
        "x1": [],
        "y1": [],
        "colour": [],
        "width": [],
    }
    for k, ds in deps.items():
        for d in ds:
            if d in pos and k in pos:
                crit = d in on_path and k in on_path
                edges["x0"].append(pos[d][0])
                edges["y0"].append(pos[d][1])
                edges["x1"].append(pos[k][0])
                edges["y1"].append(pos[k][1])
                edges["colour"].append("red" if crit else "#bbbbbb")
                edges["width"].append(2.5 if crit else 0.6)
    nodes = ColumnDataSource(node_cols, name="dag-nodes")
    fig = figure(
        title="Task graph (critical path in red)",
        height=420,
        sizing_mode="stretch_width",
        tools="pan,wheel_zoom,box_zoom,reset,save",
        active_scroll="wheel_zoom",
        name="dag",
    )
    fig.segment(
        "x0",
        "y0",
        "x1",
        "y1",
        source=ColumnDataSource(edges, name="dag-edges"),
        line_color="colour",
        line_width="width",
    )
    fig.scatter(
        "x", "y", source=nodes, size=9, fill_color="colour", line_color="line", line_width=2
    )
    fig.add_tools(
        HoverTool(
            tooltips=wrapping_tooltips(
                [
                    ("key", "@key"),
                    ("worker", "@worker"),
                    ("duration", "@duration s"),
                    ("nbytes", "@nbytes"),
                    ("type", "@typename"),
                ]
            )
        )
    )
    fig.axis.visible = False
    fig.grid.visible = False
    fig.toolbar.logo = None
    pick = Select(
        title="colour by",
        value="prefix",
        options=["prefix", "duration", "worker", "nbytes", "typename"],
        name="dag-colour-by",
    )
    pick.js_on_change(
        "value",
        CustomJS(
            args={"src": nodes},
            code="""
        src.data.colour = src.data['c_' + cb_obj.value].slice();
        src.change.emit();
    """,
        ),
    )
    return json_item(column(pick, fig, sizing_mode="stretch_width"), "dag"), len(keys)


def makespan_trend(runs: list[dict[str, Any]], current: str) -> dict[str, Any] | None:
    """Makespans of the runs of one job (same fingerprint), oldest first; this run in red."""
    pts = [r for r in runs if r.get("makespan") is not None and r.get("started_at") is not None]
    if len(pts) < 2:
        return None
    pts.sort(key=lambda r: r["started_at"])
    src = ColumnDataSource(
        {
            "i": list(range(len(pts))),
            "makespan": [r["makespan"] for r in pts],
            "id": [r["id"] for r in pts],
            "colour": ["red" if r["id"] == current else "#1f77b4" for r in pts],
        },
        name="trend-source",
    )
    # as wide as its place allows up to 420 px (a fixed 420 made a phone's page 437 px wide)
    fig = figure(
        title="Makespan of this job's runs (s), oldest first",
        height=160,
        width=420,
        max_width=420,
        sizing_mode="stretch_width",
        tools="hover",
        tooltips=[("run", "@id"), ("makespan", "@makespan s")],
        name="trend",
    )
    fig.line("i", "makespan", source=src, line_color="#1f77b4")
    fig.scatter("i", "makespan", source=src, size=7, fill_color="colour", line_color=None)
    fig.xaxis.visible = False
    fig.toolbar.logo = None
    return json_item(fig, "trend")


def side_by_side(
    a_tasks: Any, b_tasks: Any, a_name: str, b_name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two task streams one above the other on one time scale (seconds from each run's
    start): the JSON item and the two sources' columns, by source name."""
    from bokeh.layouts import column
    from bokeh.models import DataRange1d

    x_range = DataRange1d(name="compare-time")
    figs, data = [], {}
    for i, (label, tasks) in enumerate(((a_name, a_tasks), (b_name, b_tasks))):
        cols, rows, _ = task_stream_data(tasks)
        fig, _ = _stream_figure(
            f"Task stream: {label}",
            rows,
            x_range,
            name=f"compare-{i}",
            source_name=f"compare-stream-{i}",
        )
        figs.append(fig)
        data[f"compare-stream-{i}"] = cols
    return json_item(column(*figs, sizing_mode="stretch_width"), "side-by-side"), data


def gapped(points: list[dict[str, Any]], bucket_s: float) -> list[dict[str, Any] | None]:
    """Time-ordered points with None where a bucket or more holds none: a line drawn
    through them breaks there instead of joining two runs a week apart."""
    out: list[dict[str, Any] | None] = []
    for p in points:
        if out and p["time"] - out[-1]["time"] > 1.5 * bucket_s:  # type: ignore[index]
            out.append(None)
        out.append(p)
    return out


def cluster_history(rows: list[dict[str, Any]], bucket_s: float) -> dict[str, Any] | None:
    """Per-cluster runs, tasks, errors and compute-seconds per time bucket (``bucket_s``
    seconds); a cluster's lines break over buckets without runs."""
    from bokeh.layouts import column
    from bokeh.models import DataRange1d, Legend, LegendItem

    if not rows:
        return None
    clusters = sorted({r["cluster"] for r in rows})
    # One legend, above the first plot, in rows: inside each 170 px plot a fifth cluster's
    # entry would fall off the bottom.
    per_row = 2  # two names fit a phone's width (six ran off a 390 px screen)
    legend_rows = -(-len(clusters) // per_row)
    colours = {c: WORKER_PALETTE[i % len(WORKER_PALETTE)] for i, c in enumerate(clusters)}
    # runs all in one bucket: a bucket either side, not +-1 ms
    x_range = DataRange1d(name="history-time", default_span=2 * bucket_s * 1000)
    figs = []
    for field, title in (
        ("runs", "Runs started"),
        ("tasks", "Tasks"),
        ("errors", "Failed tasks"),
        ("compute_seconds", "Compute seconds"),
    ):
        first = not figs
        fig = figure(
            title=title,
            x_axis_type="datetime",
            x_range=x_range,
            height=170 + (26 * legend_rows + 30 if first else 0),
            sizing_mode="stretch_width",
            tools="xpan,xwheel_zoom,reset,save,hover",
            tooltips=[("cluster", "@cluster"), (field, "@y")],
            name=f"history-{field}",
        )
        items = []
        for c in clusters:
            mine = gapped(
                sorted((r for r in rows if r["cluster"] == c), key=lambda r: r["time"]), bucket_s
            )
            nan = float("nan")
            src = ColumnDataSource(
                {
                    "x": [r["time"] * 1000 if r else nan for r in mine],
                    "y": [(r[field] or 0) if r else nan for r in mine],
                    "cluster": [c] * len(mine),
                },
                name=f"history-{field}-line",
            )
            line = fig.line("x", "y", source=src, line_color=colours[c], line_width=2)
            fig.scatter("x", "y", source=src, fill_color=colours[c], line_color=None, size=6)
            items.append(LegendItem(label=c, renderers=[line]))
        if first:
            fig.add_layout(
                Legend(
                    items=items,
                    orientation="horizontal",
                    label_text_font_size="8pt",
                    location="top_left",
                    ncols=min(per_row, len(clusters)),
                    name="history-legend",
                ),
                "above",
            )
        fig.toolbar.logo = None
        figs.append(fig)
    return json_item(column(*figs, sizing_mode="stretch_width"), "history")
