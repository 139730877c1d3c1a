"""The run page's plots under its task stream: progress by prefix, memory by kind, CPU and
tasks processing per worker, on the stream's time range. The page fetches them
(``/runs/{id}/time-plots``) once its first view is drawn (docs/decisions/0035)."""

from __future__ import annotations

from typing import Any

from bokeh.embed import json_item

from services.dashboard.axes import bytes_axis
from services.dashboard.colours import WORKER_PALETTE, PrefixColours
from services.dashboard.plots import MEMORY_KINDS, _series_lines, _time_figure, progress_series


def time_plots_item(
    progress: dict[str, Any],
    metrics: list[dict[str, Any]],
    origin: float,
    x_end: float,
    colours: PrefixColours,
) -> dict[str, Any] | None:
    """The run page's plots under its task stream, as one Bokeh JSON item on a time range
    from 0 to ``x_end`` seconds after ``origin`` (the stream's; the page keeps the two
    ranges together): progress by prefix, memory by kind, CPU and tasks processing per
    worker, each only where it has a line (none: None)."""
    from bokeh.layouts import column
    from bokeh.models import Range1d

    x_range = Range1d(0, x_end, name="run-time-more")
    figs = []
    prog = _time_figure("Progress by prefix (tasks completed)", x_range, height=200)
    prog.name = "progress"
    series = progress_series(progress)
    n_prog = _series_lines(
        prog,
        series,
        origin,
        {s["worker"]: colours[s["worker"]] for s in series},
        "progress",
        dots=False,  # buckets, not samples
    )
    if n_prog:
        figs.append(prog)
    workers = sorted({s["worker"] for s in metrics if s["worker"] != "scheduler"})
    by_worker = {w: WORKER_PALETTE[i % len(WORKER_PALETTE)] for i, w in enumerate(workers)}
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in metrics:
        if s["worker"] != "scheduler":
            by_name.setdefault(s["name"], []).append(s)
    for metric, label in MEMORY_KINDS:
        fig = _time_figure(f"Memory: {label} bytes per worker", x_range)
        fig.name = f"memory-{label}"
        bytes_axis(fig)
        if _series_lines(fig, by_name.get(metric, []), origin, by_worker, fig.name, byte=True):
            figs.append(fig)
    for metric, title, key in (
        ("cpu", "CPU % per worker", "cpu"),
        ("tasks.processing", "Tasks processing per worker", "tasks"),
    ):
        fig = _time_figure(title, x_range)
        fig.name = key
        # no empty panel: a run without worker metrics (Ray), a metric no sample of the run
        # has (an empty one also logged a warning)
        if _series_lines(fig, by_name.get(metric, []), origin, by_worker, key):
            figs.append(fig)
    if not figs:
        return None
    figs[-1].xaxis.axis_label = "time since the run's first task"
    return json_item(column(*figs, sizing_mode="stretch_width"), "timeline-more")
