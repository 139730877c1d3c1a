"""A finished run's task stream at every zoom, built once when the run finishes (like map
tiles), so a window of a run of any size is answered from a few small blobs.

Next to the run's compacted copy, under ``stream-v1/``:

- ``index.json.zst``: the time origin (the first start/stop's start), the lanes (worker,
  thread) in the page's order, the categories (the prefixes, then the actions other than
  compute), the chunks' time ranges and the pyramid's levels;
- ``rects-N.parquet``: every start/stop of the run (lane, category, prefix, action, start,
  stop, erred, task key), sorted by start, :data:`CHUNK` a file, so a narrow window reads
  only the chunks whose time range meets it;
- ``level-K-J.npz.zst``: the pyramid. Level 0 cuts the run's span into ``cells`` equal
  cells per lane (a power of two, at most :data:`CELL_BUDGET` cells over all lanes); each
  level above has a quarter of the cells. Per lane and cell: the seconds busy (exact: each
  start/stop clipped to the cell), the start/stops counted at the cell of their midpoint,
  and the dominant category (the one busy longest there) with its seconds and count. Each
  level is cut in time into tiles of :data:`TILE` cells (tile J), so a window reads only the
  tiles it meets.

The reader is ``storage.query.task_stream``; :func:`accumulate` is shared by both, so a
window's bins and the pyramid's cells are cut the same way.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zstandard
from sqlalchemy.orm import Session

from storage.analysis.rundata import RunData
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.runs.context import FinishedRun, trim_heap
from storage.runs.runfile import RecentCache, compact_prefix, run_tag

logger = logging.getLogger(__name__)

VERSION = "stream-v1"
#: Start/stops a chunk file: small enough that a window of a few thousand reads little.
CHUNK = 16_384
#: Cells of level 0 over all lanes (4 B of seconds each, ~14 B a cell in all).
CELL_BUDGET = 1 << 20
MAX_CELLS = 1 << 16
MIN_CELLS = 256
#: Cells a lane of a pyramid tile.
TILE = 1024
#: ``dense`` picks each cell's dominant category from a table of every (cell, category)
#: up to this size (fast); past it, by sorting the entries.
DENSE_MAX = 1 << 23
COMPUTE = "compute"


class _Phase(msgspec.Struct, gc=False):
    action: str
    start: float
    stop: float


_phases = msgspec.json.Decoder(list[list[_Phase]])


@dataclass
class Rects:
    """Every start/stop of a run as columns, sorted by start. ``prefix``, ``action`` and
    ``cat`` index :attr:`prefixes`, :attr:`actions` and :attr:`cats`; ``task`` indexes the
    tasks table's rows; times are seconds since :attr:`origin`."""

    lane: Any
    cat: Any
    prefix: Any
    action: Any
    start: Any
    stop: Any
    erred: Any
    task: Any
    origin: float
    lanes: list[tuple[str, int | None]]
    prefixes: list[str]
    actions: list[str]

    @property
    def cats(self) -> list[str]:
        """Compute start/stops are categorised by prefix, the others by action."""
        return [*self.prefixes, *self.actions[1:]]


#: Tasks whose start/stops are parsed at once (bounded working memory).
PARSE_ROWS = 100_000


def _extra_phases(table: Any, rows: Any, code: dict[str, int]) -> tuple[Any, Any, Any, Any]:
    """The phases other than compute of the tasks at ``rows`` of ``table``: their task
    rows, action codes (from ``code``, which gains the actions new to it), starts and stops,
    parsed :data:`PARSE_ROWS` tasks at a time."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parts: list[tuple[Any, Any, Any, Any]] = []
    for lo in range(0, len(rows), PARSE_ROWS):
        part = rows[lo : lo + PARSE_ROWS]
        texts = pc.take(table["startstops"], pa.array(part, type=pa.int64())).to_pylist()
        parsed = _phases.decode(("[" + ",".join(s or "[]" for s in texts) + "]").encode())
        flat = [(r, ph) for r, phs in zip(part.tolist(), parsed, strict=True) for ph in phs]
        flat = [(r, ph) for r, ph in flat if ph.action != COMPUTE]
        parts.append(
            (
                np.fromiter((r for r, _ in flat), "i8", len(flat)),
                np.fromiter((code.setdefault(ph.action, len(code)) for _, ph in flat), "i2"),
                np.fromiter((ph.start for _, ph in flat), "f8", len(flat)),
                np.fromiter((ph.stop for _, ph in flat), "f8", len(flat)),
            )
        )
    if not parts:
        return np.zeros(0, "i8"), np.zeros(0, "i2"), np.zeros(0), np.zeros(0)
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(4))  # type: ignore[return-value]


def _codes(column: Any, codes: dict[Any, int], null: Any) -> Any:
    """Each row's code in ``codes`` (a value's first appearance across parts gives it the
    next code; a null is coded as ``null``), from the part's dictionary, not per row."""
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(column).combine_chunks()
    local = np.fromiter(
        (codes.setdefault(v, len(codes)) for v in encoded.dictionary.to_pylist()),
        "i8",
        len(encoded.dictionary),
    )
    nulls = encoded.indices.null_count
    idx = np.asarray(pc.fill_null(encoded.indices, 0), dtype="i8")
    out = local[idx] if len(local) else np.zeros(len(idx), "i8")
    if nulls:
        out[np.asarray(encoded.indices.is_null(), dtype=bool)] = codes.setdefault(null, len(codes))
    return out


def rects_of(table: Any) -> Rects:
    """A tasks table's start/stops, sorted by start (:func:`rects_of_parts`)."""
    return rects_of_parts([table])


def rects_of_parts(parts: Any) -> Rects:
    """A tasks table's start/stops, sorted by start, from the table's consecutive parts
    (slices of :data:`TILE_COLUMNS`): each task's compute phase from its columns, the other
    phases parsed from the start/stops of only the tasks that transferred or touched disk.
    What is kept of each task is a few numbers, so a run's parts are folded one at a time
    whatever the run's size (its phases as JSON are most of a tasks table's bytes)."""
    import pyarrow.compute as pc

    prefix_code: dict[Any, int] = {}
    action_code: dict[str, int] = {COMPUTE: 0}
    pair_code: dict[tuple[str, int | None], int] = {}
    got: dict[str, list[Any]] = {
        k: [] for k in ("cstart", "cstop", "prefix", "erred", "lane", "ex_task", "ex_action")
    }
    got.update(ex_start=[], ex_stop=[])
    n = 0
    for table in parts:
        rows = table.num_rows
        got["prefix"].append(_codes(table["prefix"], prefix_code, None).astype("i4"))
        got["cstart"].append(np.asarray(pc.fill_null(table["compute_start"], np.nan), "f8"))
        got["cstop"].append(np.asarray(pc.fill_null(table["compute_stop"], np.nan), "f8"))
        got["erred"].append(
            np.asarray(pc.fill_null(pc.equal(table["status"], "erred"), False), dtype=bool)
        )
        worker_codes: dict[Any, int] = {}
        workers = _codes(pc.fill_null(table["worker"], "?"), worker_codes, None)
        worker_of = list(worker_codes)
        thread_codes: dict[Any, int] = {}
        threads = _codes(table["thread"], thread_codes, None)
        thread_of = list(thread_codes)
        width = len(thread_of) + 1
        used, inverse = np.unique(workers * width + threads, return_inverse=True)
        gid = np.fromiter(
            (
                pair_code.setdefault((worker_of[u // width], thread_of[u % width]), len(pair_code))
                for u in used.tolist()
            ),
            "i4",
            len(used),
        )
        got["lane"].append(gid[inverse.reshape(-1)] if rows else np.zeros(0, "i4"))
        extra = np.zeros(rows)
        for col in ("transfer", "disk_read", "disk_write"):
            extra += np.asarray(pc.fill_null(table[col], 0), dtype="f8")
        ex_task, ex_action, ex_start, ex_stop = _extra_phases(
            table, np.flatnonzero(extra > 0), action_code
        )
        got["ex_task"].append(ex_task + n)
        for k, v in (("ex_action", ex_action), ("ex_start", ex_start), ("ex_stop", ex_stop)):
            got[k].append(v)
        n += rows
        del table
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in got.items()}
    del got
    prefixes = ["" if p is None else p for p in prefix_code] or [""]
    cstart, cstop = cat.pop("cstart"), cat.pop("cstop")
    computed = np.flatnonzero(~np.isnan(cstart) & ~np.isnan(cstop))
    start = np.concatenate([cstart[computed], cat.pop("ex_start")])
    sort = np.argsort(start, kind="stable")
    start = start[sort]
    stop = np.concatenate([cstop[computed], cat.pop("ex_stop")])[sort]
    del cstart, cstop
    np.maximum(stop, start, out=stop)
    origin = float(start[0]) if len(start) else 0.0
    start -= origin
    stop -= origin
    # 4 bytes a task row where they do (a 10^7-task run's start/stops are 1.3 * 10^7)
    index = "i4" if n < 2**31 else "i8"
    task = np.concatenate([computed.astype(index), cat.pop("ex_task").astype(index)])[sort]
    action = np.concatenate([np.zeros(len(computed), "i4"), cat.pop("ex_action").astype("i4")])[
        sort
    ]
    del computed, sort
    prefix = cat.pop("prefix").astype("i4")[task]
    erred = cat.pop("erred").astype(bool)[task]
    # the lanes that hold a start/stop, sorted by name as the run page's rows (lane codes
    # are few: counted, not sorted)
    lane = cat.pop("lane").astype("i4")[task]
    used = np.flatnonzero(np.bincount(lane, minlength=len(pair_code)))
    pairs_of = list(pair_code)
    pairs = [pairs_of[u] for u in used.tolist()]
    names = [wk if th is None else f"{wk}-{th}" for wk, th in pairs]
    order = sorted(range(len(pairs)), key=names.__getitem__)
    rank = np.zeros(max(len(pair_code), 1), dtype="i4")
    rank[used[order]] = np.arange(len(order), dtype="i4")
    compute = action == 0
    return Rects(
        lane=rank[lane] if len(lane) else np.zeros(0, "i4"),
        cat=np.where(compute, prefix, len(prefixes) + action - 1).astype("i4"),
        prefix=prefix,
        action=action,
        start=start,
        stop=stop,
        erred=erred & compute,
        task=task,
        origin=origin,
        lanes=[pairs[i] for i in order],
        prefixes=prefixes,
        actions=list(action_code),
    )


def accumulate(
    lane: Any, cat: Any, start: Any, stop: Any, lo: float, width: float, cells: int, n_cats: int
) -> tuple[Any, Any, Any]:
    """Start/stops cut into ``cells`` equal cells of ``width`` seconds from ``lo``: each one's
    seconds clipped to every cell it crosses, and counted once, at the cell of its midpoint
    (clamped to the cells). Returns, per (lane, cell, category) touched, its key
    ``(lane * cells + cell) * n_cats + cat`` (sorted, distinct), its seconds and its count.
    Start/stops outside ``[lo, lo + cells * width)`` add nothing outside it."""
    hi = lo + cells * width
    a = np.clip(start, lo, hi)
    b = np.clip(stop, lo, hi)
    keep = b > a
    i0 = np.minimum(((a - lo) / width).astype("i8"), cells - 1)
    i1 = np.minimum(np.maximum(((b - lo) / width).astype("i8"), 0), cells - 1)
    # A start/stop ending exactly on an edge adds nothing to the next cell.
    i1 = np.where((i1 > i0) & (lo + i1 * width >= b), i1 - 1, i1)
    base = lane.astype("i8") * cells
    same = keep & (i1 == i0)
    cross = np.flatnonzero(keep & (i1 > i0))
    keys = [(base[same] + i0[same]) * n_cats + cat[same]]
    secs = [(b - a)[same]]
    # the cell each crossing start/stop starts and ends in, and every cell between
    c0, c1 = i0[cross], i1[cross]
    keys.append((base[cross] + c0) * n_cats + cat[cross])
    secs.append(lo + (c0 + 1) * width - a[cross])
    keys.append((base[cross] + c1) * n_cats + cat[cross])
    secs.append(b[cross] - (lo + c1 * width))
    between = c1 - c0 - 1
    full = np.flatnonzero(between > 0)
    if len(full):
        reps = between[full]
        owner = np.repeat(cross[full], reps)
        step = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
        cell = np.repeat(c0[full], reps) + 1 + step
        keys.append((base[owner] + cell) * n_cats + cat[owner])
        secs.append(np.full(len(owner), width))
    mid = np.clip(((start + stop) / 2 - lo) / width, 0, cells - 1).astype("i8")
    inside = (stop > lo) & (start < hi)
    keys.append((base[inside] + mid[inside]) * n_cats + cat[inside])
    secs.append(np.zeros(int(inside.sum())))
    counted = np.concatenate(
        [np.zeros(sum(len(k) for k in keys[:-1]), "i8"), np.ones(len(keys[-1]), "i8")]
    )
    all_keys = np.concatenate(keys)
    distinct, inverse = np.unique(all_keys, return_inverse=True)
    seconds = np.bincount(inverse, weights=np.concatenate(secs), minlength=len(distinct))
    counts = np.bincount(inverse, weights=counted, minlength=len(distinct)).astype("i8")
    return distinct, seconds, counts


def merge(parts: list[tuple[Any, Any, Any]]) -> tuple[Any, Any, Any]:
    """:func:`accumulate`'s answers for parts of the same cells, added up."""
    if not parts:
        return np.zeros(0, "i8"), np.zeros(0), np.zeros(0, "i8")
    keys = np.concatenate([p[0] for p in parts])
    distinct, inverse = np.unique(keys, return_inverse=True)
    seconds = np.bincount(inverse, np.concatenate([p[1] for p in parts]), len(distinct))
    counts = np.bincount(inverse, np.concatenate([p[2] for p in parts]), len(distinct))
    return distinct, seconds, counts.astype("i8")


def dense(
    keys: Any, seconds: Any, counts: Any, n_lanes: int, cells: int, n_cats: int
) -> dict[str, Any]:
    """Per lane and cell: ``busy`` seconds, ``count`` of start/stops, and the dominant
    category ``top`` (-1 where idle) with its seconds ``top_s`` and count ``top_n``."""
    size = n_lanes * cells
    cell = keys // n_cats
    cat = keys % n_cats
    busy = np.bincount(cell, weights=seconds, minlength=size)
    count = np.bincount(cell, weights=counts, minlength=size)
    top = np.full(size, -1, dtype="i4")
    top_s = np.zeros(size)
    top_n = np.zeros(size, dtype="i8")
    if len(keys) and size * n_cats <= DENSE_MAX:
        table = np.bincount(keys, weights=seconds, minlength=size * n_cats).reshape(size, n_cats)
        tallies = np.bincount(keys, weights=counts, minlength=size * n_cats).reshape(size, n_cats)
        # the most seconds, ties (zero-second start/stops) to the most start/stops
        best = np.argmax(table + tallies * 1e-12, axis=1)
        rows = np.arange(size)
        held = np.zeros(size, dtype=bool)
        held[cell] = True
        top[held] = best[held]
        top_s = table[rows, best]
        top_n = tallies[rows, best].astype("i8")
    elif len(keys):
        # the last of each cell's entries, ordered by seconds then count, is its dominant one
        order = np.lexsort((counts, seconds, cell))
        last = np.flatnonzero(np.append(cell[order][1:] != cell[order][:-1], True))
        pick = order[last]
        top[cell[pick]] = cat[pick]
        top_s[cell[pick]] = seconds[pick]
        top_n[cell[pick]] = counts[pick]
    shape = (n_lanes, cells)
    return {
        "busy": busy.reshape(shape),
        "count": count.reshape(shape).astype("i8"),
        "top": top.reshape(shape),
        "top_s": top_s.reshape(shape),
        "top_n": top_n.reshape(shape),
    }


def level_cells(n_lanes: int, n_rects: int) -> list[int]:
    """The pyramid's cells per lane, finest first: a power of two within the budget and
    no more than the run has start/stops, each level above a quarter of the one below,
    down to :data:`MIN_CELLS`."""
    cells = MAX_CELLS
    while cells > MIN_CELLS and (cells * max(n_lanes, 1) > CELL_BUDGET or cells > 2 * n_rects):
        cells //= 2
    out = [cells]
    while out[-1] // 4 >= MIN_CELLS:
        out.append(out[-1] // 4)
    return out


def base_key(db: Session, run: m.Run) -> str:
    """Where a run's tiles are: next to the version of its compacted copy they came from."""
    return f"{compact_prefix(db, run)}/{run_tag(db, run)}/{VERSION}"


def _npz(arrays: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return zstandard.ZstdCompressor(level=3).compress(buf.getvalue())


def read_npz(body: bytes) -> dict[str, Any]:
    raw = zstandard.ZstdDecompressor().decompress(body)
    with np.load(io.BytesIO(raw)) as f:
        return {k: f[k] for k in f.files}


def _chunk_parquet(r: Rects, keys: Any, lo: int, hi: int) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sl = slice(lo, hi)
    table = pa.table(
        {
            "lane": r.lane[sl],
            "cat": r.cat[sl],
            "prefix": r.prefix[sl],
            "action": r.action[sl],
            "start": r.start[sl],
            "stop": r.stop[sl],
            "erred": r.erred[sl],
            "key": keys.take(r.task[sl]) if isinstance(keys, _KeysOf) else _take(keys, r.task[sl]),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


class _KeysOf:
    """A run's task keys, taken by rows from its tables (``RunData.take``: a compacted
    run's reads only the row groups that hold them)."""

    def __init__(self, data: RunData) -> None:
        self.data = data

    def take(self, rows: Any) -> Any:
        import pyarrow as pa

        order = np.argsort(rows, kind="stable")
        got = self.data.take("tasks", rows[order].tolist(), ["key"])["key"]
        back = np.empty(len(rows), dtype=np.int64)
        back[order] = np.arange(len(rows))
        return got.take(pa.array(back))


def _take(column: Any, rows: Any) -> Any:
    """``column.take(rows)`` of a chunked column, from only the chunks the rows are in (a
    chunked take may join every chunk into one array first: a run's keys, each time)."""
    import pyarrow as pa

    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    bounds = np.cumsum([0, *(len(c) for c in chunks)])
    which = np.searchsorted(bounds, rows, side="right") - 1
    order = np.argsort(which, kind="stable")
    which_sorted = which[order]
    cuts = np.flatnonzero(np.diff(which_sorted)) + 1
    parts = [
        chunks[int(which_sorted[g[0]])].take(pa.array(rows[order[g]] - bounds[which[order[g[0]]]]))
        for g in np.split(np.arange(len(rows)), cuts)
        if len(g)
    ]
    if not parts:
        return pa.array([], type=column.type)
    taken = pa.concat_arrays(parts)
    back = np.empty(len(rows), dtype=np.int64)
    back[order] = np.arange(len(rows))
    return taken.take(pa.array(back))


#: Start/stops accumulated at once (bounded working memory).
SLICE = 1 << 18
#: Level 0 is added up in dense arrays (8 bytes a cell and category, twice) up to this many
#: cells x categories, else by merging sparse parts.
DENSE_ADD_MAX = 1 << 24


def _level0(r: Rects, width: float, cells: int, n_cats: int) -> tuple[Any, Any, Any]:
    """:func:`accumulate` of every start/stop at level 0, a slice at a time: into dense
    arrays when the cells and categories are few enough (a sparse total merged with each
    slice held twice the cells touched, and re-sorted them every slice), else merged."""
    n, size = len(r.start), len(r.lanes) * cells * n_cats
    if size > DENSE_ADD_MAX:
        k, s, c = merge([])
        for lo in range(0, n, SLICE):
            sl = slice(lo, lo + SLICE)
            part = accumulate(
                r.lane[sl], r.cat[sl], r.start[sl], r.stop[sl], 0.0, width, cells, n_cats
            )
            k, s, c = merge([(k, s, c), part])
        return k, s, c
    seconds = np.zeros(size)
    counts = np.zeros(size, dtype=np.int64)
    for lo in range(0, n, SLICE):
        sl = slice(lo, lo + SLICE)
        pk, ps, pc_ = accumulate(
            r.lane[sl], r.cat[sl], r.start[sl], r.stop[sl], 0.0, width, cells, n_cats
        )
        seconds[pk] += ps  # (keys are distinct within a part)
        counts[pk] += pc_
    k = np.flatnonzero((seconds > 0) | (counts > 0))
    return k, seconds[k], counts[k]


def build(blobs: BlobStore, base: str, source: Any) -> dict[str, Any]:
    """Write a run's tiles under ``base`` from its tasks (``source``: a tasks table, or a
    :class:`RunData` whose tasks are read a part at a time); returns the index (written
    last: an index present means every file it names is)."""
    if isinstance(source, RunData):
        r = rects_of_parts(source.parts("tasks", list(TILE_COLUMNS)))
    else:
        r = rects_of(source)
    # the parts' arrays freed (heap holes between the kept ones) go back to the system
    trim_heap()
    n, n_lanes, cats = len(r.start), len(r.lanes), r.cats
    span = float(r.stop.max()) if n else 0.0
    span = span if span > 0 else 1.0
    levels = level_cells(n_lanes, n)
    finest = levels[0]
    k, s, c = _level0(r, span / finest, finest, len(cats))
    # the start/stops' chunks, with the keys for their hover: a run's from its copy, only
    # the row groups that hold a chunk's tasks (a start/stop's chunk is near its task's
    # row, records arriving about as tasks end), so a 10^7-task run's keys (~0.6 GB) are
    # never all held
    keys = _KeysOf(source) if isinstance(source, RunData) else source["key"]
    del source
    chunks = []
    for i, lo in enumerate(range(0, n, CHUNK)):
        hi = min(n, lo + CHUNK)
        blobs.put(f"{base}/rects-{i}.parquet", _chunk_parquet(r, keys, lo, hi))
        chunks.append([float(r.start[lo]), float(r.stop[lo:hi].max()), hi - lo])
    origin, lanes, prefixes, actions = r.origin, r.lanes, r.prefixes, r.actions
    # the start/stops are let go before the levels above (their merges, and the rects,
    # were most of a 10^7-task run's peak)
    del r, keys
    for level, cells in enumerate(levels):
        if level:  # the cells of the level below, four to one
            lane, rest = np.divmod(k // len(cats), levels[level - 1])
            k = (lane * cells + rest // (levels[level - 1] // cells)) * len(cats) + k % len(cats)
            k, s, c = merge([(k, s, c)])
        d = dense(k, s, c, n_lanes, cells, len(cats))
        for j, lo in enumerate(range(0, cells, TILE)):
            sl = (slice(None), slice(lo, lo + TILE))
            arrays = {
                "busy": d["busy"][sl].astype("f4"),
                "count": d["count"][sl].astype("i4"),
                "top": d["top"][sl].astype("i2" if len(cats) < 32_000 else "i4"),
                "top_s": d["top_s"][sl].astype("f4"),
                "top_n": d["top_n"][sl].astype("i4"),
            }
            blobs.put(f"{base}/level-{level}-{j}.npz.zst", _npz(arrays))
        del d
    del k, s, c
    index = {
        "version": VERSION,
        "count": n,
        "origin": origin,
        "span": span,
        "lanes": [list(x) for x in lanes],
        "cats": cats,
        "prefixes": prefixes,
        "actions": actions,
        "chunks": chunks,
        "levels": levels,
        "tile": TILE,
    }
    blobs.put(f"{base}/index.json.zst", zstandard.ZstdCompressor().compress(_enc(index)))
    return index


_enc = msgspec.json.Encoder().encode
_indexes = RecentCache(64)


def load_index(blobs: BlobStore, base: str) -> dict[str, Any] | None:
    """A run's tile index, or None where its tiles were not built."""
    hit = _indexes.get(base)
    if hit is not None:
        return hit
    try:
        body = blobs.get(f"{base}/index.json.zst")
    except FileNotFoundError:
        return None
    index = msgspec.json.decode(zstandard.ZstdDecompressor().decompress(body))
    _indexes.put(base, index)
    return index


def ensure(db: Session, blobs: BlobStore, run: m.Run, tasks: Any) -> dict[str, Any] | None:
    """The tile index of a run that is no longer running, building its tiles if they are
    missing (a run finished before tiles existed); None for a running run. ``tasks``: a
    function returning its tasks table or its :class:`RunData` (called only if needed)."""
    if run.status == "running":
        return None
    base = base_key(db, run)
    index = load_index(blobs, base)
    if index is None:
        index = build(blobs, base, tasks())
        logger.info(
            "built the task-stream tiles of run %s (%d start/stops)", run.public_id, index["count"]
        )
        _indexes.put(base, index)
    return index


def finish(fr: FinishedRun) -> None:
    """Finisher (``storage.jobs.finish``): the run's task-stream tiles."""
    # the columns the tiles are drawn from, a row group at a time
    ensure(fr.db, fr.blobs, fr.run, fr.data)


#: The tasks' columns :func:`build` reads.
TILE_COLUMNS = (
    "key",
    "prefix",
    "status",
    "worker",
    "thread",
    "compute_start",
    "compute_stop",
    "transfer",
    "disk_read",
    "disk_write",
    "startstops",
)
