"""Bokeh figures built from recorded runs, in Dask's visual conventions.

A task prefix has one colour on a page, the same in every plot of it (``colours.
PrefixColours``); transfers are red, disk reads and writes orange, failed computations
black, as in ``distributed.diagnostics.task_stream``. Every plot of more than one series has
a legend above it (``legends``); byte and time axes read as "977 KiB" and "2:30"
(``axes``).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

from bokeh.embed import json_item
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.plotting import figure

from services.dashboard.axes import (
    byte_hover,
    clock_axis,
    format_bytes,
    format_seconds,
    from_zero,
)
from services.dashboard.colours import PALETTE, WORKER_PALETTE, PrefixColours
from services.dashboard.legends import legend_above
from services.dashboard.task_stream import stream_figure, task_stream_data, wrapping_tooltips
from storage.runs.runfile import table_rows

logger = logging.getLogger(__name__)


@functools.cache
def warm_up() -> None:
    """Build and serialise a small run page's figures once (Bokeh fills its per-class
    property caches on first use)."""
    from bokeh.layouts import column
    from bokeh.models import DataRange1d

    x_range = DataRange1d()
    stream, _ = stream_figure(
        "warm-up", ["row"], x_range, name="warm-up", source_name="warm-up", legend=[("a", "red", 1)]
    )
    line = _time_figure("warm-up", x_range)
    _series_lines(line, [{"worker": "a", "points": [{"time": 0, "value": 1}]}], 0, {}, "warm-up")
    json_item(column(stream, line, sizing_mode="stretch_width"), "warm-up")


# ------------------------------------------------------------------ the whole run page

DAG_MAX_NODES = 5000
MEMORY_KINDS = (
    ("memory.managed", "managed"),
    ("memory.unmanaged", "unmanaged"),
    ("memory.spilled", "spilled"),
)


def _time_figure(title: str, x_range: Any, height: int = 180, **kw: Any) -> Any:
    """A plot of non-negative values over the run's time (x: seconds since its start)."""
    fig = figure(
        title=title,
        x_range=x_range,
        y_range=from_zero(),
        height=height,
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        active_scroll="xwheel_zoom",
        **kw,
    )
    clock_axis(fig)
    fig.toolbar.logo = None
    return fig


#: A line breaks where the time to its next point is longer than this many times its
#: points' median spacing: a sample or more is missing there.
GAP = 1.9
#: Points of a series drawn as dots too, up to this many: a line between two samples
#: should read as two samples.
DOTS = 40


def with_gaps(times: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    """``times``, ``values`` (time-ordered) with a NaN point where samples are missing."""
    if len(times) < 3:
        return list(times), list(values)
    steps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    limit = GAP * steps[len(steps) // 2]
    xs, ys = [times[0]], [values[0]]
    for i in range(1, len(times)):
        if limit > 0 and times[i] - times[i - 1] > limit:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(times[i])
        ys.append(values[i])
    return xs, ys


def _series_lines(
    fig: Any,
    series: list[dict[str, Any]],
    origin: float,
    colours: dict[str, str],
    name: str,
    *,
    byte: bool = False,
    dots: bool = True,
) -> int:
    """One multi-line renderer, a line per series (``worker`` names it; x: seconds since
    origin) broken where samples are missing, ``dots`` on its samples when they are few, a
    legend naming each line and its name on hover; returns how many lines were drawn. (A
    renderer per line cost ~25 ms each to build and serialise: 80 of them on a 16-worker
    run.)"""
    drawn = [s for s in series if s["points"]]
    if not drawn:
        return 0
    cols: dict[str, list[Any]] = {"xs": [], "ys": [], "colour": [], "label": []}
    marks: dict[str, list[Any]] = {"x": [], "y": [], "colour": [], "label": []}
    for s in drawn:
        pts = sorted(s["points"], key=lambda p: p["time"])
        xs, ys = with_gaps([p["time"] - origin for p in pts], [p["value"] for p in pts])
        colour = colours.get(s["worker"], "#555")
        cols["xs"].append(xs)
        cols["ys"].append(ys)
        cols["colour"].append(colour)
        cols["label"].append(s["worker"])
        if dots and len(pts) <= DOTS:
            marks["x"] += [p["time"] - origin for p in pts]
            marks["y"] += [p["value"] for p in pts]
            marks["colour"] += [colour] * len(pts)
            marks["label"] += [s["worker"]] * len(pts)
    band = _envelopes(drawn, origin, colours)
    if band["xs"]:  # under the lines: each downsampled series' min-max band
        fig.patches(
            "xs",
            "ys",
            source=ColumnDataSource(band, name=f"{name}-envelope"),
            fill_color="colour",
            fill_alpha=0.18,
            line_color=None,
        )
    lines = fig.multi_line(
        "xs", "ys", source=ColumnDataSource(cols, name=name), line_color="colour", line_width=1.5
    )
    renderers = [lines]
    if marks["x"]:
        renderers.append(
            fig.scatter(
                "x",
                "y",
                source=ColumnDataSource(marks, name=f"{name}-dots"),
                size=4,
                fill_color="colour",
                line_color=None,
            )
        )
    value = ("value", "$y{custom}" if byte else "$y{0.[00]a}")
    fig.add_tools(
        HoverTool(
            renderers=renderers,
            tooltips=[("", "@label"), value],
            formatters={"$y": byte_hover()} if byte else {},
            line_policy="nearest",
        )
    )
    legend_above(
        fig, [(label, lines, i) for i, label in enumerate(cols["label"])], f"{name}-legend"
    )
    return len(drawn)


def _envelopes(
    series: list[dict[str, Any]], origin: float, colours: dict[str, str]
) -> dict[str, list[Any]]:
    """Polygons of each series' per-point ``min`` to ``max`` (points that stand for a time
    bin of samples), one per stretch between missing samples; none where every point is a
    single sample (min equal to max): one renderer for every series of a plot."""
    out: dict[str, list[Any]] = {"xs": [], "ys": [], "colour": []}
    for s in series:
        pts = sorted(s["points"], key=lambda p: p["time"])
        if not any(p.get("min", p["value"]) != p.get("max", p["value"]) for p in pts):
            continue
        xs, _ = with_gaps([p["time"] - origin for p in pts], [0.0] * len(pts))
        stretch: list[dict[str, Any]] = []
        i = 0
        for x in [*xs, math.nan]:
            if x == x:
                stretch.append(pts[i])
                i += 1
                continue
            if len(stretch) > 1:
                ts = [p["time"] - origin for p in stretch]
                out["xs"].append(ts + ts[::-1])
                out["ys"].append(
                    [p.get("max", p["value"]) for p in stretch]
                    + [p.get("min", p["value"]) for p in stretch][::-1]
                )
                out["colour"].append(colours.get(s["worker"], "#555"))
            stretch = []
    return out


def progress_series(progress: dict[str, Any]) -> list[dict[str, Any]]:
    """Completed tasks per prefix over time (cumulative), each prefix's line from the
    bucket before its first completion (a flat zero until a prefix starts said nothing)."""
    times = progress.get("times") or []
    width = progress.get("bucket_seconds") or 0.0
    series = []
    for prefix, counts in sorted(progress.get("prefixes", {}).items()):
        first = next((i for i, c in enumerate(counts) if c), 0)
        total, points = 0, [{"time": times[first] - width, "value": 0}]
        for t, c in zip(times[first:], counts[first:], strict=True):
            total += c
            points.append({"time": t, "value": total})
        series.append({"worker": prefix, "points": points})
    return series


def run_page_items(
    data: Any,
    critical: dict[str, Any],
    progress: dict[str, Any],
    metrics: list[dict[str, Any]] | None,
    *,
    inline_keys: bool = False,
    colours: PrefixColours | None = None,
    windowed: tuple[dict[str, Any], list[str], float, list[Any]] | None = None,
) -> dict[str, Any]:
    """A run page's first view and its graph as Bokeh JSON items: ``timeline`` the task
    stream alone, on a fixed time range from the run's first task (``x_end``: to the last
    stop or sample of it and of ``progress`` and ``metrics``, padded as Bokeh pads a
    fitted range; a big run's to its span); ``dag`` the task graph. The progress, memory,
    CPU and processing plots under the stream (:func:`time_plots_item`, on that range)
    the page fetches once its first view is drawn. The task stream's keys (the hover's) are
    left out unless ``inline_keys`` (a running run, whose tasks change between requests).
    ``colours``: the page's prefix colours (by default the run's own). ``windowed``: the
    task stream as ``task_stream.windowed_stream`` gives it, fetched by the page in windows
    (a big run)."""
    from bokeh.models import Range1d, Span

    if colours is None:
        colours = PrefixColours(data.tasks.column("prefix").to_pylist())
    # Without the task keys (the hover's; half of a 100k-task run's page): the page fetches
    # them from /runs/<id>/stream-keys while it builds its figures.
    if windowed is None:
        cols, rows, origin, legend = task_stream_data(data.tasks, keys=inline_keys, colours=colours)
        lo, hi = cols.pop("extent")
        # as a range fitted to the stream and the time plots: they share it
        lo, hi = _time_extent(lo, hi, progress, metrics or [], origin)
        x_end = hi + 0.05 * ((hi - lo) or 1.0) if hi > lo else max(hi, 0.0) + 1.0
    else:
        cols, rows, origin, legend = windowed
        x_end = cols["span"]
    x_range = Range1d(0, x_end, name="run-time")
    stream, _ = stream_figure(
        "Task stream",
        rows,
        x_range,
        name="task-stream",
        source_name="task-stream-source",
        legend=legend,
    )
    # Replay's cursor (services/dashboard/static/replay.js moves it to the slider's time)
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
    if not progress_series(progress) and not metrics:  # no time plot under it
        stream.xaxis.axis_label = "time since the run's first task"
    dag, dag_nodes = dag_item(data, critical, colours)
    return {
        "timeline": json_item(stream, "timeline"),
        "stream": cols,
        "origin": origin,
        "x_end": x_end,
        "dag": dag,
        "counts": {
            "glyphs": cols["count"] if windowed is None else 0,
            "rows": len(rows),
            "dag_nodes": dag_nodes,
        },
    }


def _time_extent(
    lo: float, hi: float, progress: dict[str, Any], metrics: list[dict[str, Any]], origin: float
) -> tuple[float, float]:
    """The stream's ``lo``-``hi`` (seconds from ``origin``) widened to the time plots'
    points, what one range fitted to all of them spans."""
    times = [p["time"] - origin for s in metrics for p in s["points"]]
    pts = progress_series(progress)
    times += [p["time"] - origin for s in pts for p in s["points"]]
    times = [t for t in times if t == t]
    if times:
        lo, hi = min(lo, min(times)), max(hi, max(times))
    return lo, hi


#: Bins of the task graph's colours by a number (duration, bytes): viridis, log scale.
RAMP = (PALETTE[0], PALETTE[4], PALETTE[8], PALETTE[11], PALETTE[14], PALETTE[17])
MISSING = "#cccccc"

#: A colouring of the task graph: each node's colour, and the legend's entries (label, the
#: first node of that colour).
Colouring = tuple[list[str], list[tuple[str, int]]]


def _firsts(groups: list[Any], avoid: set[int]) -> dict[Any, int]:
    """The first index of each group, one not in ``avoid`` where the group has one."""
    first: dict[Any, int] = {}
    for i, g in enumerate(groups):
        if g not in first or (first[g] in avoid and i not in avoid):
            first[g] = i
    return first


def _ramp(values: list[float | None], label: Any, avoid: set[int]) -> Colouring:
    """Colours for numbers in :data:`RAMP`'s bins (log scale), grey for missing; an entry
    per bin drawn, its range written by ``label``, its swatch a node not in ``avoid``."""
    logs = [math.log10(v) if v and v > 0 else None for v in values]
    present = [v for v in logs if v is not None]
    if not present:
        return [MISSING] * len(values), ([("missing", 0)] if values else [])
    lo, hi = min(present), max(present)
    span = (hi - lo) or 1.0
    bins = [
        None if v is None else min(len(RAMP) - 1, int((v - lo) / span * len(RAMP))) for v in logs
    ]
    first = _firsts([-1 if b is None else b for b in bins], avoid)
    entries = []
    for b in sorted(k for k in first if k >= 0):
        a, z = lo + span * b / len(RAMP), lo + span * (b + 1) / len(RAMP)
        entries.append((f"{label(10**a)} to {label(10**z)}", first[b]))
    if -1 in first:
        entries.append(("missing", first[-1]))
    return [MISSING if b is None else RAMP[b] for b in bins], entries


def _categories(values: list[Any], avoid: set[int], colour: Any = None) -> Colouring:
    """A colour per value (``colour(value)``, by default the worker palette in turn, values
    sorted); an entry per value, sorted, its swatch a node not in ``avoid``."""
    names = sorted({str(v or "") for v in values})
    if colour is None:
        index = {v: WORKER_PALETTE[i % len(WORKER_PALETTE)] for i, v in enumerate(names)}
        colour = index.__getitem__
    first = _firsts([str(v or "") for v in values], avoid)
    return [colour(str(v or "")) for v in values], [(n or "none", first[n]) for n in names]


def dag_item(
    data: Any, critical: dict[str, Any], colours: PrefixColours | None = None
) -> tuple[dict[str, Any] | None, int]:
    """The task graph laid out by depth (longest chain from a root), coloured by an attribute
    picked from a dropdown (as the Dask Log Server prototype did), its legend following the
    pick; the critical path in red. Prefixes take the page's ``colours``."""
    from bokeh.layouts import column
    from bokeh.models import CustomJS, LegendItem, Select

    n_tasks, n_graph = table_rows(data, "tasks"), table_rows(data, "graph")
    if n_tasks > DAG_MAX_NODES or n_graph > DAG_MAX_NODES:
        return None, max(n_tasks, n_graph)
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
    }
    if colours is None:
        colours = PrefixColours(node_cols["prefix"])
    # the legend's swatches are nodes off the critical path (outlined red)
    outlined = {i for i, k in enumerate(keys) if k in on_path}
    by: dict[str, Colouring] = {
        "prefix": _categories(node_cols["prefix"], outlined, colours.__getitem__),
        "duration": _ramp(node_cols["duration"], format_seconds, outlined),
        "worker": _categories(node_cols["worker"], outlined),
        "nbytes": _ramp(node_cols["nbytes"], format_bytes, outlined),
        "typename": _categories(node_cols["typename"], outlined),
    }
    for option, (node_colours, _) in by.items():
        node_cols[f"c_{option}"] = node_colours
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
    dots = fig.scatter(
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
    legend = legend_above(fig, [(label, dots, i) for label, i in by["prefix"][1]], "dag-legend")
    items = {
        option: [LegendItem(label=label, renderers=[dots], index=i) for label, i in entries]
        for option, (_, entries) in by.items()
        if option != "prefix"
    }
    items["prefix"] = legend.items
    pick = Select(
        title="colour by",
        value="prefix",
        options=list(by),
        name="dag-colour-by",
    )
    pick.js_on_change(
        "value",
        CustomJS(
            args={"src": nodes, "legend": legend, "items": items},
            code="""
        src.data.colour = src.data['c_' + cb_obj.value].slice();
        legend.items = items[cb_obj.value];
        src.change.emit();
        if (typeof fitLegends === "function") fitLegends();
    """,
        ),
    )
    return json_item(column(pick, fig, sizing_mode="stretch_width"), "dag"), len(keys)


def grouped_dag_item(grouped: dict[str, Any], colours: PrefixColours) -> dict[str, Any] | None:
    """A graph past :data:`DAG_MAX_NODES` drawn by prefix (``outcome.graph_groups``, stored
    with the page's facts): a node a group, by depth, its area as its task count; an edge
    as wide as the log of the task dependencies it stands for. What the browser lays out
    stays the same whatever the run's size."""
    groups = grouped.get("groups") or []
    if not groups:
        return None
    levels: dict[int, list[str]] = {}
    for g in groups:
        levels.setdefault(g["depth"], []).append(g["prefix"])
    pos = {}
    for lvl, names in levels.items():
        for i, name in enumerate(names):
            pos[name] = (lvl, i - (len(names) - 1) / 2)
    top = max(g["tasks"] for g in groups)
    nodes = {
        "x": [pos[g["prefix"]][0] for g in groups],
        "y": [pos[g["prefix"]][1] for g in groups],
        "prefix": [g["prefix"] for g in groups],
        "tasks": [g["tasks"] for g in groups],
        "size": [8 + 32 * math.sqrt(g["tasks"] / top) for g in groups],
        "colour": [colours[g["prefix"]] for g in groups],
    }
    edges: dict[str, list[Any]] = {k: [] for k in ("x0", "y0", "x1", "y1", "count", "width")}
    for e in grouped.get("edges") or []:
        (x0, y0), (x1, y1) = pos[e["src"]], pos[e["dst"]]
        for k, v in zip(("x0", "y0", "x1", "y1"), (x0, y0, x1, y1), strict=True):
            edges[k].append(v)
        edges["count"].append(e["count"])
        edges["width"].append(0.8 + math.log10(e["count"]))
    fig = figure(
        title="Task graph by prefix (a node per task group, its area its tasks)",
        height=420,
        sizing_mode="stretch_width",
        tools="pan,wheel_zoom,box_zoom,reset,save",
        active_scroll="wheel_zoom",
        name="dag",
    )
    lines = fig.segment(
        "x0",
        "y0",
        "x1",
        "y1",
        source=ColumnDataSource(edges, name="dag-edges"),
        line_color="#999999",
        line_alpha=0.6,
        line_width="width",
    )
    dots = fig.scatter(
        "x",
        "y",
        source=ColumnDataSource(nodes, name="dag-nodes"),
        size="size",
        fill_color="colour",
        line_color="#555555",
    )
    fig.text("x", "y", text="prefix", source=dots.data_source, y_offset=-14, text_font_size="9pt")
    fig.add_tools(
        HoverTool(renderers=[dots], tooltips=[("prefix", "@prefix"), ("tasks", "@tasks{0,0}")]),
        HoverTool(renderers=[lines], tooltips=[("task dependencies", "@count{0,0}")]),
    )
    fig.axis.visible = False
    fig.grid.visible = False
    fig.toolbar.logo = None
    return json_item(fig, "dag")


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
        y_range=from_zero(),
        name="trend",
    )
    fig.line("i", "makespan", source=src, line_color="#1f77b4")
    fig.scatter("i", "makespan", source=src, size=7, fill_color="colour", line_color=None)
    fig.xaxis.visible = False
    fig.toolbar.logo = None
    return json_item(fig, "trend")


def side_by_side(
    a_tasks: Any,
    b_tasks: Any,
    a_name: str,
    b_name: str,
    windowed: tuple[Any, Any] = (None, None),
    colours: PrefixColours | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two task streams one above the other on one time scale (seconds from each run's
    start): the JSON item and the two sources' columns, by source name. ``windowed``: for
    each run, its stream as ``task_stream.windowed_stream`` gives it (a big run's, fetched
    by the page in windows) or None (sent whole); with either, the time range is fixed to
    the longer run's span. ``colours``: the prefixes' (by default both runs')."""
    from bokeh.layouts import column
    from bokeh.models import DataRange1d, Range1d

    if colours is None:  # a prefix of both runs has one colour in both streams
        colours = PrefixColours(
            a_tasks.column("prefix").to_pylist() + b_tasks.column("prefix").to_pylist()
        )
    spans = [w[0]["span"] for w in windowed if w is not None]
    x_range: Any = DataRange1d(name="compare-time", start=0)
    if spans:
        pairs = zip((a_tasks, b_tasks), windowed, strict=True)
        longest = max(spans + [_span(t) for t, w in pairs if w is None])
        x_range = Range1d(0, longest, name="compare-time")
    figs, data = [], {}
    for i, (label, tasks) in enumerate(((a_name, a_tasks), (b_name, b_tasks))):
        if windowed[i] is None:
            cols, rows, _, legend = task_stream_data(tasks, colours=colours)
        else:
            cols, rows, _, legend = windowed[i]
        fig, _ = stream_figure(
            f"Task stream: {label}",
            rows,
            x_range,
            name=f"compare-{i}",
            source_name=f"compare-stream-{i}",
            legend=legend,
        )
        figs.append(fig)
        data[f"compare-stream-{i}"] = cols
    return json_item(column(*figs, sizing_mode="stretch_width"), "side-by-side"), data


def _span(tasks: Any) -> float:
    """Seconds from a run's first start to its last stop, by its tasks."""
    import pyarrow.compute as pc

    lo, hi = pc.min(tasks["start"]).as_py(), pc.max(tasks["stop"]).as_py()
    return (hi - lo) if lo is not None and hi is not None and hi > lo else 1.0


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
            y_range=from_zero(),
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
