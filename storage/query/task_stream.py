"""A window of a run's task stream at the detail a screen can show: the start/stops
themselves when the window holds few enough to draw, else per lane and pixel the seconds
busy and the dominant prefix (or action). A finished run is read from its tiles
(``storage.runs.streamtiles``): a narrow window from the chunks of start/stops that meet
it, a wide one from the pyramid level with a few cells a pixel; a running run from its
tasks table.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.runs import streamtiles as tiles
from storage.runs.runfile import RecentCache, load_run

logger = logging.getLogger(__name__)

#: The most start/stops a window answers one by one (the route's ``max_rects`` at most).
MAX_RECTS = 50_000
#: A window whose chunks hold at most this many start/stops is binned from them exactly;
#: a wider one from the pyramid.
EXACT_MAX = 200_000
#: Pyramid cells a pixel wanted at least (fewer, and the level below is read).
CELLS_PER_BIN = 2
#: A window of more than MAX_RECTS start/stops is binned from the pyramid, not exactly,
#: when the finest level has this many cells a pixel: a whole 130,000-start/stop run took
#: ~110 ms binned exactly, ~30 ms from the pyramid, and a bin of 8 cells or more is off
#: by at most the busy seconds of the cells its edges cut, spread evenly.
FINE_CELLS_PER_BIN = 8
MAX_WIDTH = 4000

_chunks = RecentCache(48)
_levels = RecentCache(6)


class BadWindow(ValueError):
    """The window asked for is not one the run can answer (its message says why)."""


@dataclass
class Window:
    """Start/stops as columns (times since the run's origin), read for one window."""

    lane: Any
    cat: Any
    prefix: Any
    action: Any
    start: Any
    stop: Any
    erred: Any
    key: Any  # a callable of indices -> keys, so only drawn rects' keys are made


def _chunk(blobs: BlobStore, key: str) -> Any:
    import pyarrow.parquet as pq

    hit = _chunks.get(key)
    if hit is None:
        hit = pq.read_table(io.BytesIO(blobs.get(key)))
        _chunks.put(key, hit)
    return hit


def _level(blobs: BlobStore, key: str) -> dict[str, Any]:
    hit = _levels.get(key)
    if hit is None:
        hit = tiles.read_npz(blobs.get(key))
        _levels.put(key, hit)
    return hit


def _from_chunks(blobs: BlobStore, base: str, picked: list[int]) -> Window:
    import pyarrow as pa

    tables = [_chunk(blobs, f"{base}/rects-{i}.parquet") for i in picked]
    t = pa.concat_tables(tables) if tables else None

    def col(name: str, dtype: str) -> Any:
        return np.asarray(t[name], dtype=dtype) if t is not None else np.zeros(0, dtype)

    keys = t["key"] if t is not None else pa.array([], pa.string())
    return Window(
        col("lane", "i4"),
        col("cat", "i4"),
        col("prefix", "i4"),
        col("action", "i4"),
        col("start", "f8"),
        col("stop", "f8"),
        col("erred", "bool"),
        lambda idx: keys.take(pa.array(idx, type=pa.int64())).to_pylist(),
    )


def _from_table(r: tiles.Rects, table: Any) -> Window:
    import pyarrow as pa

    keys = table["key"]
    return Window(
        r.lane,
        r.cat,
        r.prefix,
        r.action,
        r.start,
        r.stop,
        r.erred,
        lambda idx: keys.take(pa.array(r.task[idx], type=pa.int64())).to_pylist(),
    )


def window(
    db: Session,
    blobs: BlobStore,
    run: m.Run,
    start: float | None,
    stop: float | None,
    width: int,
    max_rects: int = MAX_RECTS,
) -> dict[str, Any]:
    """The task stream of ``run`` between ``start`` and ``stop`` (epoch seconds; by default
    the run's first start to its last stop) for ``width`` pixels: ``mode`` "rects" with
    every start/stop that overlaps the window when there are at most ``max_rects``, else
    "bins": ``width`` equal bins per lane. Raises :class:`BadWindow`."""
    # a run finished before its tiles existed: built from its copy a row group at a time
    index = tiles.ensure(db, blobs, run, lambda: load_run(db, blobs, run, lazy=True))
    if index is not None:
        return answer(blobs, tiles.base_key(db, run), index, start, stop, width, max_rects)
    # running: from its tasks as they are now
    table = load_run(db, blobs, run).tasks
    r = tiles.rects_of(table)
    span = float(r.stop.max()) if len(r.stop) else 1.0
    index = {
        "count": len(r.start),
        "origin": r.origin,
        "span": span if span > 0 else 1.0,
        "lanes": r.lanes,
        "cats": r.cats,
        "prefixes": r.prefixes,
        "actions": r.actions,
    }
    return answer(blobs, "", index, start, stop, width, max_rects, _from_table(r, table))


def answer(
    blobs: BlobStore,
    base: str,
    index: dict[str, Any],
    start: float | None,
    stop: float | None,
    width: int,
    max_rects: int = MAX_RECTS,
    held: Window | None = None,
) -> dict[str, Any]:
    """:func:`window` from a run's tile index (under ``base``), or from start/stops
    ``held`` in memory."""
    origin, span = index["origin"], index["span"]
    a = 0.0 if start is None else start - origin
    b = span if stop is None else stop - origin
    if not b > a:
        raise BadWindow("stop must be later than start")
    out: dict[str, Any] = {
        "start": origin + a,
        "stop": origin + b,
        "width": width,
        "origin": origin,
        "lanes": [{"worker": w, "thread": t} for w, t in index["lanes"]],
        "names": index["cats"],
    }
    if held is not None:
        win = held
    else:
        picked = [i for i, (lo, hi, _) in enumerate(index["chunks"]) if lo < b and hi > a]
        held_n = sum(index["chunks"][i][2] for i in picked)
        fine = index["levels"][0] * (b - a) / span >= FINE_CELLS_PER_BIN * width
        if held_n > EXACT_MAX or (held_n > MAX_RECTS and fine):
            return _with_edges({**out, "mode": "bins", **_pyramid(blobs, base, index, a, b, width)})
        win = _from_chunks(blobs, base, picked)
    inside = np.flatnonzero(
        ((win.start < b) & (win.stop > a))
        | ((win.start == win.stop) & (win.start >= a) & (win.start < b))
    )
    out["count"] = len(inside)
    if len(inside) <= max_rects:
        return {**out, "mode": "rects", "rects": _rects(win, inside, origin, index)}
    n_lanes = len(index["lanes"])
    bins = _exact_bins(win, inside, a, b, width, n_lanes, len(index["cats"]))
    return _with_edges({**out, "mode": "bins", **bins})


def _with_edges(answer: dict[str, Any]) -> dict[str, Any]:
    """The bins' edges: width + 1 epoch times from the window's start to its stop, first."""
    a, b, width = answer["start"], answer["stop"], answer["width"]
    edges = (a + (b - a) * np.arange(width + 1) / width).tolist()
    answer["bins"] = {"edges": edges, **answer["bins"]}
    return answer


def _rects(win: Window, idx: Any, origin: float, index: dict[str, Any]) -> dict[str, Any]:
    prefixes, actions = index["prefixes"], index["actions"]
    return {
        "lane": win.lane[idx].tolist(),
        "key": win.key(idx),
        "prefix": [prefixes[i] for i in win.prefix[idx].tolist()],
        "action": [actions[i] for i in win.action[idx].tolist()],
        "start": (win.start[idx] + origin).tolist(),
        "stop": (win.stop[idx] + origin).tolist(),
        "erred": win.erred[idx].tolist(),
    }


def _bins_json(busy: Any, count: Any, top: Any, top_n: Any) -> dict[str, Any]:
    return {
        "bins": {
            "busy": np.round(busy, 6).tolist(),
            "prefix": top.tolist(),
            "count": count.tolist(),
            "prefix_count": top_n.tolist(),
        }
    }


def _exact_bins(
    win: Window, idx: Any, a: float, b: float, width: int, n_lanes: int, n_cats: int
) -> dict[str, Any]:
    k, s, c = tiles.accumulate(
        win.lane[idx],
        win.cat[idx],
        win.start[idx],
        win.stop[idx],
        a,
        (b - a) / width,
        width,
        n_cats,
    )
    d = tiles.dense(k, s, c, n_lanes, width, n_cats)
    return _bins_json(d["busy"], d["count"], d["top"], d["top_n"]) | {"source": "rects"}


def _pyramid(
    blobs: BlobStore, base: str, index: dict[str, Any], a: float, b: float, width: int
) -> dict[str, Any]:
    """Bins from the coarsest pyramid level with :data:`CELLS_PER_BIN` cells a bin in the
    window (the finest level where none has), read from the tiles the window meets: busy
    seconds spread evenly within a cell where a bin edge cuts it; counts and dominance from
    the cells whose middle is in a bin."""
    span, levels, tile = index["span"], index["levels"], index["tile"]
    want = CELLS_PER_BIN * width * span / (b - a)
    level = next((i for i in range(len(levels) - 1, -1, -1) if levels[i] >= want), 0)
    cells = levels[level]
    w = span / cells
    first = int(np.clip(np.floor(a / w), 0, cells - 1))
    last = int(np.clip(np.ceil(b / w), first + 1, cells))
    t0, t1 = first // tile, (last - 1) // tile + 1
    parts = [_level(blobs, f"{base}/level-{level}-{j}.npz.zst") for j in range(t0, t1)]
    lo = t0 * tile  # the first cell read
    cut = slice(first - lo, last - lo)

    def col(name: str, dtype: str) -> Any:
        return np.concatenate([p[name] for p in parts], axis=1)[:, cut].astype(dtype)

    busy, count_c = col("busy", "f8"), col("count", "i8")
    top, top_s, top_n = col("top", "i8"), col("top_s", "f8"), col("top_n", "i8")
    n_lanes, n = busy.shape
    # busy seconds up to each bin edge, cells cut by an edge taken pro rata
    edges = a + (b - a) * np.arange(width + 1) / width
    pos = np.clip(edges / w - first, 0, n)
    cell = np.minimum(pos.astype("i8"), n - 1)
    frac = pos - cell
    cum = np.zeros((n_lanes, n + 1))
    np.cumsum(busy, axis=1, out=cum[:, 1:])
    at = cum[:, cell] + frac * busy[:, cell]
    bin_busy = np.maximum(np.diff(at, axis=1), 0.0)
    # each cell in the bin of its middle (clamped to the window)
    mids = (np.arange(first, last) + 0.5) * w
    to_bin = np.clip(((mids - a) / (b - a) * width).astype("i8"), 0, width - 1)
    lane = np.repeat(np.arange(n_lanes), n)
    slot = lane * width + np.tile(to_bin, n_lanes)
    count = np.bincount(slot, count_c.ravel(), n_lanes * width).reshape(n_lanes, width)
    n_cats = len(index["cats"])
    held = top.ravel() >= 0
    key = (slot * n_cats + top.ravel())[held]
    d = tiles.dense(key, top_s.ravel()[held], top_n.ravel()[held], n_lanes, width, n_cats)
    return _bins_json(bin_busy, count.astype("i8"), d["top"], d["top_n"]) | {
        "source": f"pyramid level {level} ({cells} cells a lane)"
    }
