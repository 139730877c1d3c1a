"""The task stream: a run's task phases as compact columns for the page to expand, and
the figure they fill, painted as an image by hindsight.js, with a legend of the prefixes
and actions it draws (Dask's colours for actions and failures, the page's for prefixes)."""

from __future__ import annotations

import base64
import logging
import math
from itertools import chain
from typing import Any

import msgspec
import numpy as np
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.plotting import figure

from services.dashboard.axes import clock_axis
from services.dashboard.colours import ACTION_COLOURS, ERRED, OTHER_ACTION, PrefixColours
from services.dashboard.legends import legend_above

logger = logging.getLogger(__name__)


class _Phase(msgspec.Struct, gc=False):
    action: str
    start: float
    stop: float


_phases = msgspec.json.Decoder(list[list[_Phase]])


#: A legend entry of the task stream: label, colour, alpha.
Swatch = tuple[str, str, float]


def task_stream_data(
    table: Any, *, keys: bool = True, colours: PrefixColours | None = None
) -> tuple[dict[str, Any], list[str], float, list[Swatch]]:
    """A run's task stream, compactly: one rectangle per startstop as typed arrays (base64),
    with task keys, labels and colours sent once and referenced by index. The page expands
    it (``expandStream``) into the columns the figure's source wants. Returns the payload,
    the worker-thread rows, the time origin and the legend's entries (the prefixes computed,
    then failures and the other actions, as drawn). ``colours``: the page's prefix colours
    (by default the run's own).

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
    if colours is None:
        colours = PrefixColours(prefix_of)
    names: dict[str, int] = {}
    shades: dict[tuple[str, float], int] = {}
    name_of = np.asarray([names.setdefault(p, len(names)) for p in prefix_of], dtype="i4")
    colour_of_prefix = [shades.setdefault((colours[p], 1.0), len(shades)) for p in prefix_of]
    prefix_name = name_of[prefix_idx]
    prefix_colour = np.asarray(colour_of_prefix, dtype="i4")[prefix_idx]
    black = shades.setdefault((ERRED, 1.0), len(shades))
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
        [shades.setdefault(ACTION_COLOURS.get(a, OTHER_ACTION), len(shades)) for a in action_of],
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
        "colours": [list(ca) for ca in shades],
        # seconds from the origin its rectangles span: the page's time range is fitted to it
        "extent": [float((x - width / 2).min()), float((x + width / 2).max())]
        if len(x)
        else [0.0, 0.0],
    }
    if keys:
        payload["keys"] = stream_keys(table)
    else:  # the page requests them (``stream_keys``) while it builds its figures
        payload["tasks"] = table.num_rows
    computed = np.unique(prefix_idx[tasks_c[~erred[tasks_c]]]).tolist()
    legend = sorted((prefix_of[i] or "", colours[prefix_of[i]], 1.0) for i in computed)
    if erred[tasks_c].any():
        legend.append(("failed", ERRED, 1.0))
    # one entry per colour: disk reads and writes share one
    shown: dict[tuple[str, float], list[str]] = {}
    for a in sorted(action_of):
        shown.setdefault(ACTION_COLOURS.get(a, OTHER_ACTION), []).append(a)
    legend += [(" / ".join(acts), c, alpha) for (c, alpha), acts in shown.items()]
    return payload, rows, origin, legend


def windowed_stream(
    index: dict[str, Any], url: str, colours: PrefixColours, max_rects: int
) -> tuple[dict[str, Any], list[str], float, list[Swatch]]:
    """A run's task stream for the page to fetch in windows (``streamWindows`` in
    hindsight.js) from the task-stream route, from its tile index: the payload, the rows,
    the time origin and the legend, as :func:`task_stream_data` gives for a stream sent
    whole. The page paints bins at overview and the start/stops themselves once a window
    holds at most ``max_rects``."""
    prefixes, actions = index["prefixes"], index["actions"][1:]
    styles = {p: (colours[p], 1.0) for p in prefixes}
    styles |= {a: ACTION_COLOURS.get(a, OTHER_ACTION) for a in actions}
    payload = {
        "url": url,
        "origin": index["origin"],
        "span": index["span"],
        "count": index["count"],
        "max_rects": max_rects,
        "styles": {name: list(style) for name, style in styles.items()},
        "erred": ERRED,
    }
    rows = [w if t is None else f"{w}-{t}" for w, t in index["lanes"]]
    legend: list[Swatch] = sorted((p, colours[p], 1.0) for p in prefixes)
    shown: dict[tuple[str, float], list[str]] = {}
    for a in sorted(actions):
        shown.setdefault(ACTION_COLOURS.get(a, OTHER_ACTION), []).append(a)
    legend += [(" / ".join(acts), c, alpha) for (c, alpha), acts in shown.items()]
    return payload, rows, index["origin"], legend


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


def stream_figure(
    title: str,
    rows: list[str],
    x_range: Any,
    *,
    name: str,
    source_name: str,
    legend: list[Swatch],
) -> tuple[Any, Any]:
    """A task-stream figure with empty sources: the page fills ``source.data`` from plain
    arrays after embedding (Bokeh's per-element serialisation of 100k-row columns took
    seconds in Python and more in the browser), and its painted copy, ``painted-NAME``: an
    image of them at the screen's resolution (``rasterise`` in hindsight.js). The per-task
    rectangles are drawn by nothing; they answer the hover. The legend's swatches are one
    renderer's rows, off the plot (NaN places), one entry each."""
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
    clock_axis(fig)
    fig.toolbar.logo = None
    if legend:
        nan = [math.nan] * len(legend)
        swatches = fig.rect(
            x="x",
            y="y",
            width=1,
            height=1,
            source=ColumnDataSource(
                {
                    "x": nan,
                    "y": nan,
                    "label": [label for label, _, _ in legend],
                    "colour": [c for _, c, _ in legend],
                    "alpha": [a for _, _, a in legend],
                },
                name=f"{name}-legend-source",
            ),
            fill_color="colour",
            fill_alpha="alpha",
            line_color=None,
        )
        entries = [(label, swatches, i) for i, (label, _, _) in enumerate(legend)]
        legend_above(fig, entries, f"{name}-legend")
    return fig, source
