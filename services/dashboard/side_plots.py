"""The run page's plot of values emitted with ``hindsight.emit``: each numeric stream's mean
per interval, its min-max band, and the values per interval in the hover."""

from __future__ import annotations

from typing import Any

from bokeh.embed import json_item
from bokeh.layouts import column
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.plotting import figure

from services.dashboard.axes import clock_axis
from services.dashboard.colours import WORKER_PALETTE

#: Numeric streams drawn (the most valued first); the rest are listed with their counts.
MAX_PLOTTED = 6


def streams_chart(
    series: list[tuple[str, dict[str, Any]]], t0: float | None, name: str = "streams"
) -> dict[str, Any] | None:
    """``series``: (stream, aggregate from ``storage.runs.runlogs.aggregate``) of numeric
    streams; times are drawn in seconds from ``t0`` (the run's start)."""
    figs = []
    x_range = None
    for i, (stream, agg) in enumerate(series[:MAX_PLOTTED]):
        pts = agg["points"]
        base = t0 if t0 is not None else agg["start"]
        mid = agg["interval"] / 2
        src = ColumnDataSource(
            {
                "t": [p["time"] + mid - base for p in pts],
                "mean": [p["mean"] for p in pts],
                "lo": [p["min"] for p in pts],
                "hi": [p["max"] for p in pts],
                "count": [p["count"] for p in pts],
                "sum": [p["sum"] for p in pts],
            },
            name=f"{name}-{i}-source",
        )
        colour = WORKER_PALETTE[i % len(WORKER_PALETTE)]
        fig = figure(
            title=f"{stream}: mean per {agg['interval']:.3g} s (band: min to max)",
            height=180,
            sizing_mode="stretch_width",
            tools="xpan,xwheel_zoom,save,reset",
            name=f"{name}-{i}",
            **({"x_range": x_range} if x_range is not None else {}),
        )
        x_range = fig.x_range
        fig.varea(x="t", y1="lo", y2="hi", source=src, fill_color=colour, fill_alpha=0.2)
        line = fig.line(x="t", y="mean", source=src, line_color=colour, line_width=2)
        fig.scatter(x="t", y="mean", source=src, color=colour, size=4)
        fig.add_tools(
            HoverTool(
                renderers=[line],
                tooltips=[
                    ("s from start", "@t{0.000}"),
                    ("values", "@count"),
                    ("mean", "@mean"),
                    ("min", "@lo"),
                    ("max", "@hi"),
                    ("sum", "@sum"),
                ],
                mode="vline",
            )
        )
        fig.xaxis.axis_label = "time from the run's start"
        clock_axis(fig)
        fig.toolbar.logo = None
        figs.append(fig)
    if not figs:
        return None
    return json_item(column(*figs, sizing_mode="stretch_width", name=name), name)
