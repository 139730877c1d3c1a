"""Bokeh figures of why a run was slow: flame graphs of statistical profiles (one run's,
the difference of two), Dask's fine-performance-metrics view, and seconds by activity
over time. Drawn locally by BokehJS from the wheel (no CDN).

Conventions follow Dask's dashboard: a profile frame is coloured by its file
(``distributed.profile.plot_data`` colours by filename), a task prefix by the page's prefix
colour (``colours.PrefixColours``); clicking a frame zooms to it, the reset tool zooms out.
"""

from __future__ import annotations

import logging
from typing import Any

from bokeh.embed import json_item
from bokeh.models import (
    ColumnDataSource,
    CustomJS,
    DataRange1d,
    FactorRange,
    HoverTool,
    Range1d,
    TapTool,
)
from bokeh.plotting import figure

from services.dashboard.axes import from_zero
from services.dashboard.colours import WORKER_PALETTE, PrefixColours, colour_of
from services.dashboard.legends import legend_above
from services.dashboard.plots import gapped
from services.dashboard.task_stream import wrapping_tooltips
from storage.analysis import flame
from storage.analysis.profile import Node, Profile, merge_into, prune

logger = logging.getLogger(__name__)

#: Frames drawn at most per flame graph (the least sampled are folded into their callers).
MAX_FRAMES = 2500
#: A flame graph is as tall as its levels holding a frame this wide (of the whole) or
#: wider, ROW_PX a level, between MIN_PX and MAX_PX; narrower frames above them are a pan
#: (or a click on a frame below) away.
SHOWN_WIDTH = 0.002
ROW_PX, MIN_PX, MAX_PX = 18, 110, 640
#: Activity colours (the rest cycle through WORKER_PALETTE).
ACTIVITY_COLOURS = {
    "thread-cpu": "#1f77b4",
    "thread-noncpu": "#ff7f0e",
    "executor": "#9467bd",
    "other": "#7f7f7f",
    "idle or other spans": "#dddddd",
    "disk-read": "#8c564b",
    "disk-write": "#c49c94",
    "compress": "#2ca02c",
    "decompress": "#98df8a",
    "serialize": "#e377c2",
    "deserialize": "#f7b6d2",
    "network": "#d62728",
}


#: The activity view's seconds of no task prefix of the run.
UNKNOWN = "#c7c7c7"


def activity_colour(activity: str, i: int = 0) -> str:
    return ACTIVITY_COLOURS.get(activity, WORKER_PALETTE[i % len(WORKER_PALETTE)])


_ZOOM = """
const i = src.selected.indices[0];
if (i === undefined) return;
const l = src.data.left[i], r = src.data.right[i];
xr.start = l; xr.end = r;
src.selected.indices = [];
"""


def _quads(
    rows: list[tuple[int, float, float, str, str, str, int, int]],
    interval: float,
    total: int,
    colours: PrefixColours,
) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {
        k: []
        for k in (
            "bottom",
            "top",
            "left",
            "right",
            "name",
            "where",
            "line",
            "samples",
            "seconds",
            "pct",
            "colour",
        )
    }
    for depth, left, right, name, where, line, samples, _ in rows:
        cols["bottom"].append(depth)
        cols["top"].append(depth + 0.95)
        cols["left"].append(left)
        cols["right"].append(right)
        cols["name"].append(name)
        cols["where"].append(where)
        cols["line"].append(line)
        cols["samples"].append(samples)
        cols["seconds"].append(round(samples * interval, 3))
        cols["pct"].append(f"{100 * samples / total:.1f}%" if total else "")
        # Frames by their file (as Dask colours them); a task prefix level by the prefix.
        cols["colour"].append(colour_of(where.rsplit(":", 1)[0]) if where else colours[name])
    return cols


def _layout(p: Profile) -> tuple[list[tuple[Any, ...]], int]:
    """Flame-graph rectangles of a tree, x in [0, 1] by samples, depth 0 at the bottom;
    children left to right by samples, most first."""
    total = p.root.count
    out: list[tuple[Any, ...]] = []
    if not total:
        return out, 0
    stack: list[tuple[Any, Node, float, float, int]] = [(None, p.root, 0.0, 1.0, -1)]
    while stack:
        fid, node, left, right, depth = stack.pop()
        if fid is not None:
            key = p.keys[fid]
            line_number, line = p.lines[fid]
            where = flame.where(key[1], key[2])
            out.append((depth, left, right, key[0], where, line, node.count, line_number))
        x = left
        scale = (right - left) / node.count if node.count else 0.0
        for k, child in sorted(node.children.items(), key=lambda kv: -kv[1].count):
            w = child.count * scale
            stack.append((k, child, x, x + w, depth + 1))
            x += w
    return out, total


def flame_graph(
    p: Profile, title: str, name: str, colours: PrefixColours | None = None
) -> dict[str, Any] | None:
    """A flame graph of ``p`` as a Bokeh JSON item (None when there are no samples); its
    frames of task prefixes (:func:`by_prefix`) in the page's ``colours``."""
    if not p.samples:
        return None
    prune(p, MAX_FRAMES)
    rows, total = _layout(p)
    if colours is None:
        colours = PrefixColours(r[3] for r in rows if r[0] == 0)
    tooltips = [
        ("function", "@name"),
        ("where", "@where"),
        ("first sampled line", "@line"),
        ("samples", "@samples (@pct)"),
        ("seconds", "@seconds"),
    ]
    fig = _frames_figure(_quads(rows, p.interval, total, colours), title, name, tooltips)
    return json_item(fig, name)


def _frames_figure(
    cols: dict[str, list[Any]], title: str, name: str, tooltips: list[tuple[str, str]]
) -> Any:
    """A flame-graph figure of frame rectangles (x in [0, 1], a row per depth): hover
    tooltips, click a frame to zoom to it, names on the frames wide enough; as tall as its
    levels of frames one can see (:data:`SHOWN_WIDTH`)."""
    depth = max(cols["bottom"], default=0) + 1
    shown = 1 + max(
        (
            b
            for b, left, right in zip(cols["bottom"], cols["left"], cols["right"], strict=True)
            if right - left >= SHOWN_WIDTH
        ),
        default=0,
    )
    src = ColumnDataSource(cols, name=f"{name}-source")
    x_range = Range1d(0, 1, bounds=(0, 1), name=f"{name}-x")
    fig = figure(
        title=title,
        x_range=x_range,
        y_range=Range1d(
            0, min(shown, (MAX_PX - 60) // ROW_PX) + 0.2, bounds=(0, depth + 0.2), name=f"{name}-y"
        ),
        height=max(MIN_PX, min(MAX_PX, 60 + ROW_PX * shown)),
        sizing_mode="stretch_width",
        tools="pan,xwheel_zoom,reset,save",
        active_scroll="xwheel_zoom",
        name=name,
    )
    r = fig.quad(
        "left",
        "right",
        "top",
        "bottom",
        source=src,
        fill_color="colour",
        line_color="white",
        line_width=0.5,
        hover_fill_alpha=0.7,
    )
    fig.add_tools(HoverTool(renderers=[r], tooltips=wrapping_tooltips(tooltips)))  # paths run long
    fig.add_tools(
        TapTool(renderers=[r], callback=CustomJS(args={"src": src, "xr": x_range}, code=_ZOOM))
    )
    _labels(fig, cols, name)
    fig.axis.visible = False
    fig.grid.visible = False
    fig.toolbar.logo = None
    return fig


#: Characters of a frame's name that fit across the whole plot's width (8pt text).
LABEL_CHARS = 180


def _labels(fig: Any, cols: dict[str, list[Any]], name: str) -> None:
    """Names on the frames wide enough to hold a few characters, cut to fit."""
    keep = [i for i in range(len(cols["left"])) if cols["right"][i] - cols["left"][i] > 0.02]
    text = []
    for i in keep:
        fits = int((cols["right"][i] - cols["left"][i]) * LABEL_CHARS) - 1
        n = cols["name"][i]
        text.append(n if len(n) <= fits else n[: max(fits - 1, 1)] + "…")
    labels = ColumnDataSource(
        {
            "x": [cols["left"][i] for i in keep],
            "y": [cols["bottom"][i] for i in keep],
            "text": text,
            "colour": [_ink(cols["colour"][i]) for i in keep],
        },
        name=f"{name}-labels",
    )
    fig.text(
        "x",
        "y",
        text="text",
        source=labels,
        text_font_size="8pt",
        x_offset=3,
        y_offset=-3,
        text_baseline="bottom",
        text_color="colour",
    )


def _ink(fill: str) -> str:
    """Black or white text, whichever reads on ``fill`` (#rrggbb)."""
    if not fill.startswith("#") or len(fill) != 7:
        return "black"
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "white"


def by_prefix(trees: dict[str, Profile]) -> Profile:
    """One tree with a first level per task prefix (a frame named after the prefix)."""
    out = Profile()
    for prefix, tree in sorted(trees.items()):
        level = Profile(interval=tree.interval)
        top = level.root.children[level.intern((prefix, "", 0), (0, ""))] = Node()
        top.count = level.root.count = tree.root.count
        remap = {f: level.intern(k, tree.lines[f]) for f, k in tree.keys.items()}
        stack = [(top, tree.root)]
        while stack:
            d, s = stack.pop()
            for f, c in s.children.items():
                n = d.children[remap[f]] = Node()
                n.count = c.count
                stack.append((n, c))
        merge_into(out, level)
        out.interval = tree.interval
    return out


def diff_graph(tree: dict[str, Any], title: str, name: str) -> dict[str, Any] | None:
    """The difference of two profiles (``storage.analysis.flame.diff``) as a flame graph: widths
    are run b's share of samples, red where b spends more seconds than a, blue fewer."""
    if not tree.get("b"):
        return None
    cols: dict[str, list[Any]] = {
        k: []
        for k in ("bottom", "top", "left", "right", "name", "where", "a", "b", "delta", "colour")
    }
    stack: list[tuple[dict[str, Any], float, float, int]] = [(tree, 0.0, 1.0, -1)]
    drawn = 0
    # full colour at a change of a fifth of the larger profile's seconds
    scale_s = 0.2 * max(tree.get("seconds_a", 0.0), tree.get("seconds_b", 0.0)) or 1.0
    while stack and drawn < MAX_FRAMES:
        node, left, right, depth = stack.pop()
        if depth >= 0:
            drawn += 1
            cols["bottom"].append(depth)
            cols["top"].append(depth + 0.95)
            cols["left"].append(left)
            cols["right"].append(right)
            cols["name"].append(node["name"])
            cols["where"].append(flame.where(node["filename"], node["first_line"]))
            cols["a"].append(f"{100 * node['share_a']:.1f}%")
            cols["b"].append(f"{100 * node['share_b']:.1f}%")
            cols["delta"].append(
                f"{node['delta']:+.2f} s ({node['seconds_a']:.2f} -> {node['seconds_b']:.2f} s;"
                f" share {100 * node['share_delta']:+.1f} points)"
            )
            # by seconds, not share: a step 2x slower is red even when another grew more
            cols["colour"].append(_delta_colour(0.2 * node["delta"] / scale_s))
        x = left
        scale = (right - left) / node["b"] if node["b"] else 0.0
        for child in node["children"]:
            if not child["b"]:
                continue
            w = child["b"] * scale
            if w < 1e-4:
                continue
            stack.append((child, x, x + w, depth + 1))
            x += w
    tooltips = [
        ("function", "@name"),
        ("where", "@where"),
        ("share in a", "@a"),
        ("share in b", "@b"),
        ("change", "@delta"),
    ]
    fig = _frames_figure(cols, title, name, tooltips)
    return json_item(fig, name)


def _delta_colour(delta: float) -> str:
    """White for no change, to red (b spends more) or blue (less), full at 0.2 (of the
    scale the caller divided by)."""
    t = max(-1.0, min(1.0, delta / 0.2))
    fade = int(235 - 200 * abs(t))
    if t > 0:
        return f"#{235:02x}{fade:02x}{fade:02x}"
    return f"#{fade:02x}{fade:02x}{235:02x}"


def activity_chart(
    activity: list[dict[str, Any]],
    name: str = "activity",
    colours: PrefixColours | None = None,
) -> dict[str, Any] | None:
    """Dask's fine performance metrics view: seconds by activity (bars, largest first),
    each bar split by task prefix in the page's prefix ``colours``, hatched where the
    seconds were spent outside a task's execution (gathering its dependencies, say); a
    legend of what each colour is. Seconds of no task prefix of the run (Dask's idle time)
    are grey."""
    seconds: dict[str, dict[str, float]] = {}
    for row in activity:
        if row["unit"] != "seconds" or row["value"] <= 0:
            continue
        who = row["prefix"] if row["context"] == "execute" else f"{row['context']}: {row['prefix']}"
        per = seconds.setdefault(row["activity"], {})
        per[who] = per.get(who, 0.0) + row["value"]
    if not seconds:
        return None
    if colours is None:
        colours = PrefixColours(who.split(": ")[-1] for per in seconds.values() for who in per)
    order = sorted(seconds, key=lambda a: -sum(seconds[a].values()))
    cols: dict[str, list[Any]] = {
        k: [] for k in ("activity", "bottom", "top", "prefix", "seconds", "colour", "hatch")
    }
    for act in order:
        bottom = 0.0
        for who, v in sorted(seconds[act].items(), key=lambda kv: -kv[1]):
            cols["activity"].append(act)
            cols["bottom"].append(bottom)
            cols["top"].append(bottom + v)
            cols["prefix"].append(who)
            cols["seconds"].append(round(v, 4))
            prefix = who.split(": ")[-1]
            cols["colour"].append(colours[prefix] if prefix in colours else UNKNOWN)
            cols["hatch"].append(" " if ": " not in who else "/")
            bottom += v
    src = ColumnDataSource(cols, name=f"{name}-source")
    fig = figure(
        title="Where the time went: seconds by activity, split by task prefix (Dask's fine "
        "performance metrics)",
        x_range=FactorRange(*order, name=f"{name}-activities"),
        y_range=from_zero(),
        height=320,
        sizing_mode="stretch_width",
        tools="save,reset",
        name=name,
    )
    r = fig.vbar(
        x="activity",
        bottom="bottom",
        top="top",
        width=0.8,
        source=src,
        fill_color="colour",
        hatch_pattern="hatch",
        hatch_color="white",
        hatch_alpha=0.7,
        line_color="white",
    )
    fig.add_tools(
        HoverTool(
            renderers=[r],
            tooltips=[("activity", "@activity"), ("prefix", "@prefix"), ("seconds", "@seconds")],
        )
    )
    # an entry per prefix (and context), most seconds first
    total: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, (who, v) in enumerate(zip(cols["prefix"], cols["seconds"], strict=True)):
        total[who] = total.get(who, 0.0) + v
        first.setdefault(who, i)
    entries = [(who, r, first[who]) for who in sorted(total, key=lambda w: (-total[w], w))]
    legend_above(fig, entries, f"{name}-legend")
    fig.yaxis.axis_label = "seconds"
    fig.xaxis.major_label_orientation = 0.5
    fig.xgrid.visible = False
    fig.toolbar.logo = None
    return json_item(fig, name)


def activity_history_chart(
    points: list[dict[str, Any]], title: str, bucket_s: float = 86400
) -> dict[str, Any] | None:
    """Mean seconds per run by activity, per time bucket: one line per activity."""
    if not points:
        return None
    activities = sorted({a for p in points for a in p["activity"]})
    fig = figure(
        title=title,
        x_axis_type="datetime",
        height=300,
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,reset,save",
        name="activity-history",
        # at least three buckets wide, so a single bucket is not drawn on a microsecond axis
        x_range=DataRange1d(min_interval=3 * bucket_s * 1000, name="activity-history-x"),
        y_range=from_zero(),
    )
    entries = []
    for i, act in enumerate(activities):
        # the line breaks over buckets without runs of it
        mine = gapped(
            sorted((p for p in points if act in p["activity"]), key=lambda p: p["time"]), bucket_s
        )
        nan = float("nan")
        src = ColumnDataSource(
            {
                "x": [p["time"] * 1000 if p else nan for p in mine],
                "y": [p["activity"][act]["mean"] if p else nan for p in mine],
                "runs": [p["runs"] if p else 0 for p in mine],
                "activity": [act] * len(mine),
            },
            name=f"activity-history-{i}",
        )
        colour = activity_colour(act, i)
        line = fig.line("x", "y", source=src, line_color=colour, line_width=2)
        entries.append((act, line, None))
        r = fig.scatter("x", "y", source=src, fill_color=colour, line_color=None, size=7)
        fig.add_tools(
            HoverTool(
                renderers=[r],
                tooltips=[
                    ("activity", "@activity"),
                    ("seconds per run", "@y{0.000}"),
                    ("runs", "@runs"),
                ],
                formatters={},
            )
        )
    fig.yaxis.axis_label = "seconds per run"
    legend_above(fig, entries, "activity-history-legend").click_policy = "hide"
    fig.toolbar.logo = None
    return json_item(fig, "activity-history")
