"""Bokeh figures built from recorded runs, in Dask's visual conventions.

Colours follow ``distributed.diagnostics.task_stream``: a colour per task prefix (md5 of the
prefix into an 18-colour viridis palette), transfers red, disk reads and writes orange,
failed computations black.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from bokeh.embed import json_item
from bokeh.models import ColumnDataSource, FactorRange, HoverTool
from bokeh.plotting import figure

# distributed.utils.palette (viridis, 18 colours)
PALETTE = (
    "#440154", "#471669", "#472A79", "#433C84", "#3C4D8A", "#355D8C", "#2E6C8E", "#287A8E",
    "#23898D", "#1E978A", "#20A585", "#2EB27C", "#45BF6F", "#64CB5D", "#88D547", "#AFDC2E",
    "#D7E219", "#FDE724",
)  # fmt: skip
ACTION_COLOURS = {
    "transfer": ("red", 0.4),
    "disk-read": ("orange", 0.4),
    "disk-write": ("orange", 0.4),
}


def colour_of(prefix: str) -> str:
    """Dask's colour for a task prefix (``distributed.diagnostics.progress_stream.color_of``)."""
    n = int(hashlib.md5(prefix.encode()).hexdigest()[:8], 16)
    return PALETTE[n % len(PALETTE)]


def task_stream_data(
    tasks: Iterable[dict[str, Any]],
) -> tuple[dict[str, list[Any]], list[str], float]:
    """Columns of one rectangle per startstop, the worker-thread rows, and the time origin."""
    cols: dict[str, list[Any]] = {
        k: [] for k in ("x", "width", "y", "colour", "alpha", "key", "name", "duration")
    }
    records = list(tasks)
    origin = min((ss["start"] for t in records for ss in t["startstops"]), default=0.0)
    rows: set[str] = set()
    for t in records:
        row = f"{t.get('worker') or '?'}-{t.get('thread') if t.get('thread') is not None else 0}"
        failed = t.get("status") == "erred"
        for ss in t["startstops"]:
            action = ss["action"]
            if action == "compute":
                colour, alpha = ("black" if failed else colour_of(t["prefix"])), 1.0
            else:
                colour, alpha = ACTION_COLOURS.get(action, ("gray", 0.4))
            duration = ss["stop"] - ss["start"]
            cols["x"].append((ss["start"] + ss["stop"]) / 2 - origin)
            cols["width"].append(duration)
            cols["y"].append(row)
            cols["colour"].append(colour)
            cols["alpha"].append(alpha)
            cols["key"].append(t["key"])
            cols["name"].append(f"{action} {t['prefix']}" if action != "compute" else t["prefix"])
            cols["duration"].append(f"{duration * 1000:.1f} ms")
            rows.add(row)
    return cols, sorted(rows), origin


def task_stream(tasks: Iterable[dict[str, Any]], *, target: str = "task-stream") -> dict[str, Any]:
    """The task stream of a run as a Bokeh JSON item: a row per worker thread."""
    cols, rows, _ = task_stream_data(tasks)
    source = ColumnDataSource(cols, name="task-stream-source")
    fig = figure(
        name="task-stream",
        title="Task stream",
        y_range=FactorRange(*rows, name="task-stream-rows"),
        x_axis_label="seconds since the run's first task",
        height=max(220, 26 * len(rows) + 90),
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        active_scroll="xwheel_zoom",
        output_backend="webgl",
    )
    fig.rect(
        x="x", y="y", width="width", height=0.85, source=source, fill_color="colour",
        fill_alpha="alpha", line_color=None, name="task-stream-rects",
    )  # fmt: skip
    fig.add_tools(
        HoverTool(tooltips=[("task", "@name"), ("key", "@key"), ("duration", "@duration")])
    )
    fig.yaxis.major_label_text_font_size = "8pt"
    return json_item(fig, target)
