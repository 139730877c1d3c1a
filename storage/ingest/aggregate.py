"""One pass over a batch: every figure the index takes from it, as typed records.

This is the collector's hottest code after decoding, so it is shaped for speed: one Python
loop copies what each task and phase contributes into flat lists (codes for runs,
prefixes and workers; one entry per phase), and every sum, minimum, maximum and histogram
is then taken with NumPy over those arrays. Times are bounded by the schema
(``hindsight.schema.MAX_TIME``), so every phase can be bucketed.

Every figure here adds, or takes a minimum or maximum, so the index can merge batches in
any order (see ``storage.ingest.writer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hindsight.schema import (
    ActivityEvent,
    Batch,
    CodeEvent,
    GraphEvent,
    ProfileEvent,
    RunEvent,
    SessionEvent,
    StateEvent,
    TaskEvent,
    WorkerEvent,
)
from storage.analysis import sketch
from storage.analysis.runfacts import (
    ACTION_COLUMNS,
    TaskPhases,
    action_index,
    flatten_phases,
    task_phases,
)
from storage.core.batches import DEFAULT_RUN

_INT64_MAX = 2**63 - 1
_COMPUTE, _TRANSFER, _DISK_READ, _DISK_WRITE, _OTHER = range(len(ACTION_COLUMNS))


@dataclass(slots=True)
class ActionStats:
    """Durations of one action of one prefix: count, total, min, max (seconds)."""

    count: int
    total: float
    min: float
    max: float


@dataclass(slots=True)
class PrefixStats:
    count: int
    errors: int
    nbytes: int


@dataclass(slots=True)
class WorkerStats:
    """A worker's share of a run: tasks, errors, seconds by action column, first/last."""

    tasks: int
    errors: int
    seconds: list[float]  # by runfacts.ACTION_COLUMNS
    first_start: float | None
    last_stop: float | None


@dataclass(slots=True)
class RunAggregate:
    """What one batch adds to one run."""

    tasks: int = 0
    errors: int = 0
    graph: int = 0
    nbytes: int = 0
    task_start: float | None = None
    task_stop: float | None = None
    statuses: dict[str, int] = field(default_factory=dict)
    prefixes: dict[str, PrefixStats] = field(default_factory=dict)
    actions: dict[tuple[str, str], ActionStats] = field(default_factory=dict)
    # (prefix, action) -> {sketch bucket: count}
    hists: dict[tuple[str, str], dict[int, int]] = field(default_factory=dict)
    workers: dict[str, WorkerStats] = field(default_factory=dict)
    events: list[RunEvent] = field(default_factory=list)


@dataclass(slots=True)
class HourStats:
    """Tasks of a cluster by the hour of their first start."""

    tasks: int
    errors: int
    compute: float
    transfer: float
    disk: float
    nbytes: int


@dataclass(slots=True)
class DayStats:
    """Durations of one prefix and action by the day of each phase's start."""

    count: int
    total: float
    max: float
    buckets: dict[int, int]


@dataclass(slots=True)
class BatchAggregate:
    runs: dict[str, RunAggregate] = field(default_factory=dict)
    hours: dict[int, HourStats] = field(default_factory=dict)
    # (prefix, action, day) -> stats
    days: dict[tuple[str, str, int], DayStats] = field(default_factory=dict)
    workers: list[WorkerEvent] = field(default_factory=list)
    session: SessionEvent | None = None
    # Dask's fine performance metrics, the submitting code and replay samples
    # (``storage.ingest.perf_index``)
    perf: list[ActivityEvent | CodeEvent | StateEvent] = field(default_factory=list)
    # the earliest and latest event time in the batch (None: no timed event)
    t_min: float | None = None
    t_max: float | None = None


def _segments(*keys: Any) -> tuple[Any, Any]:
    """Sort by ``keys`` (the last is the primary key, as for ``np.lexsort``) and return the
    order and the start of each run of equal keys in it."""
    order = np.lexsort(keys)
    change = np.zeros(len(order), dtype=bool)
    if len(order):
        change[0] = True
        for k in keys:
            s = k[order]
            change[1:] |= s[1:] != s[:-1]
    return order, np.flatnonzero(change)


def _opt(x: float) -> float | None:
    return None if x != x else x  # NaN -> None


@dataclass(slots=True)
class _Tasks:
    """A batch's task events as arrays: one entry per task (``run``, ``prefix``, ``worker``
    codes, ``nbytes``, ``err``) and one per phase (``ph_*``, ``d`` the duration)."""

    n: int
    run_names: list[str]
    prefix_names: list[str]
    worker_names: list[str | None]
    action_names: list[str]
    run: Any
    prefix: Any
    worker: Any
    nbytes: Any
    err: Any
    statuses: list[str]
    all_memory: bool  # every task's status is "memory" (the common case)
    ph_task: Any
    ph_action: Any
    start: Any
    d: Any
    phases: TaskPhases


def _codes(values: list[Any]) -> tuple[list[Any], Any]:
    """The distinct values in order of appearance, and each value's index among them
    (None is a value like any other). Pure Python in C loops: pyarrow's dictionary encoding
    was no faster on a batch and hands work to its thread pool, slow on a busy machine.
    The one-value probe compares rather than hashes: on a freshly decoded batch (its strings
    cold, their hashes not yet computed) ``dict.fromkeys`` alone cost more (8.50 -> 9.19 ms
    for the aggregation pass), though it was faster on a batch aggregated again."""
    first = values[0]
    # one run, one worker...: the common case. The last value and one in the middle are
    # probed first: a column of many values (prefixes, workers, actions) then skips the
    # full count, a compare of every value wasted.
    if (
        values[-1] == first
        and values[len(values) // 2] == first
        and values.count(first) == len(values)
    ):
        return [first], np.zeros(len(values), dtype=np.int64)
    index = {v: i for i, v in enumerate(dict.fromkeys(values))}
    codes = np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values))
    return list(index), codes


def _columns(tasks: list[TaskEvent]) -> _Tasks:
    """Columns of the task events: list comprehensions pull each field (the fastest
    Python-level loop), dicts code the strings, NumPy does the rest. A Python loop
    that updated per-run, per-prefix and per-worker totals task by task cost ~3x more."""
    n = len(tasks)
    run_names, run = _codes([DEFAULT_RUN if e.run is None else e.run for e in tasks])
    prefix_names, prefix = _codes([e.prefix for e in tasks])
    worker_names, worker = _codes([e.worker for e in tasks])
    # float sums: exact below 2**53 bytes, saturated (not wrapped) beyond; None -> NaN -> 0
    nbytes = np.nan_to_num(np.array([e.nbytes for e in tasks], dtype=np.float64))
    statuses = [e.status for e in tasks]
    all_memory = statuses.count("memory") == n
    err = np.zeros(n, dtype=np.float64)
    if not all_memory:
        err[[i for i, s in enumerate(statuses) if s == "erred"]] = 1.0
    ph_task, actions, start, stop = flatten_phases(tasks)
    if actions:
        action_names, ph_action = _codes(actions)
    else:
        action_names, ph_action = [], np.zeros(0, dtype=np.int64)
    column = np.array([action_index(a) for a in action_names], dtype=np.int64)
    phases = task_phases(ph_task, column[ph_action], start, stop, n)
    return _Tasks(
        n,
        run_names,
        prefix_names,
        worker_names,
        action_names,
        run,
        prefix,
        worker,
        nbytes,
        err,
        statuses,
        all_memory,
        ph_task,
        ph_action,
        start,
        stop - start,
        phases,
    )


def aggregate(batch: Batch) -> BatchAggregate:
    """Everything the index takes from ``batch``, before touching the database."""
    out = BatchAggregate()
    runs = out.runs
    events = batch.events
    # Task events are nearly all of a batch: picked out in one C-level loop, and the rest
    # looked at only when there is a rest.
    tasks: list[TaskEvent] = [ev for ev in events if type(ev) is TaskEvent]
    rest = [ev for ev in events if type(ev) is not TaskEvent] if len(tasks) < len(events) else []
    times: list[float] = []
    for ev in rest:
        t = type(ev)
        if t is ProfileEvent:
            times += (ev.start, ev.stop)
        elif t is not GraphEvent:
            time = getattr(ev, "time", None)
            if time is not None:
                times.append(time)
        if t is GraphEvent:
            rs = runs.get(ev.run or DEFAULT_RUN)
            if rs is None:
                rs = runs[ev.run or DEFAULT_RUN] = RunAggregate()
            rs.graph += 1
        elif t is RunEvent:
            rs = runs.get(ev.id)
            if rs is None:
                rs = runs[ev.id] = RunAggregate()
            rs.events.append(ev)
        elif t is WorkerEvent:
            out.workers.append(ev)
        elif t is SessionEvent:
            out.session = ev
        elif t is ActivityEvent or t is CodeEvent or t is StateEvent:
            out.perf.append(ev)
            if ev.run not in runs:
                runs[ev.run] = RunAggregate()
    if times:
        out.t_min, out.t_max = min(times), max(times)
    if tasks:
        c = _columns(tasks)
        if len(c.start):
            # a phase's start and stop both count (a stop before its start is accepted)
            stops = c.start + c.d
            lo = float(min(c.start.min(), stops.min()))
            hi = float(max(c.start.max(), stops.max()))
            out.t_min = lo if out.t_min is None else min(out.t_min, lo)
            out.t_max = hi if out.t_max is None else max(out.t_max, hi)
        for rk in c.run_names:
            if rk not in runs:
                runs[rk] = RunAggregate()
        aggs = [runs[rk] for rk in c.run_names]
        _per_run(c, aggs)
        _per_prefix(c, aggs)
        _per_worker(c, aggs)
        _per_hour(c, out)
        if len(c.ph_task):
            # each phase's histogram bucket, once for both groupings
            buckets = _distinct(sketch.buckets(c.d))
            _per_action(c, aggs, buckets)
            day = np.floor(c.start / 86400).astype(np.int64)
            d0 = int(day.min())
            if len(aggs) == 1 and int(day.max()) == d0:
                # One run, one day (most batches): the day's groups are the run's, already
                # summed (the same phases, sorted alike), so not grouped a second time.
                rs = aggs[0]
                for (p, a), st in rs.actions.items():
                    out.days[(p, a, d0)] = DayStats(st.count, st.total, st.max, rs.hists[(p, a)])
            else:
                _per_day(c, out, buckets, day, d0)
    return out


def _distinct(b: Any) -> tuple[Any, Any]:
    """``np.unique(b, return_inverse=True)`` of histogram buckets without a sort: they are
    small integers in a narrow range (and :data:`sketch.ZERO`), so a presence table and a
    running count give each one's rank."""
    zero = b == sketch.ZERO
    has_zero = bool(zero.any())
    real = b[~zero] if has_zero else b
    if not len(real):
        return np.unique(b, return_inverse=True)
    lo, hi = int(real.min()), int(real.max())
    if hi - lo > 4 * len(b) + 4096:  # a sparse spread: the sort is cheaper
        return np.unique(b, return_inverse=True)
    slot = b - (lo - 1)  # slot 0 is ZERO, below every real bucket
    if has_zero:
        slot[zero] = 0
    present = np.zeros(hi - lo + 2, dtype=bool)
    present[slot] = True
    values = np.flatnonzero(present) + (lo - 1)
    if has_zero:
        values[0] = sketch.ZERO
    return values, (np.cumsum(present) - 1)[slot]


def _per_run(c: _Tasks, aggs: list[RunAggregate]) -> None:
    """Tasks, errors, bytes, first start, last stop and statuses of each run."""
    order, starts = _segments(c.run)
    counts = np.diff(starts, append=c.n)
    errors = np.add.reduceat(c.err[order], starts)
    nbytes = np.add.reduceat(c.nbytes[order], starts)
    first = np.fmin.reduceat(c.phases.start[order], starts)
    last = np.fmax.reduceat(c.phases.stop[order], starts)
    for r, n, e, nb, f, la in zip(
        c.run[order[starts]].tolist(),
        counts.tolist(),
        errors.tolist(),
        nbytes.tolist(),
        first.tolist(),
        last.tolist(),
        strict=True,
    ):
        rs = aggs[r]
        rs.tasks, rs.errors, rs.nbytes = n, int(e), min(int(nb), _INT64_MAX)
        rs.task_start, rs.task_stop = _opt(f), _opt(la)
        rs.statuses = {"memory": n}
    if c.all_memory:
        return
    for i, status in enumerate(c.statuses):
        if status != "memory":
            st = aggs[c.run[i]].statuses
            st["memory"] -= 1
            st[status] = st.get(status, 0) + 1
    for rs in aggs:
        if rs.statuses.get("memory") == 0:
            del rs.statuses["memory"]


def _per_prefix(c: _Tasks, aggs: list[RunAggregate]) -> None:
    order, starts = _segments(c.prefix, c.run)
    counts = np.diff(starts, append=c.n)
    errors = np.add.reduceat(c.err[order], starts)
    nbytes = np.add.reduceat(c.nbytes[order], starts)
    heads = order[starts]
    for r, p, n, e, nb in zip(
        c.run[heads].tolist(),
        c.prefix[heads].tolist(),
        counts.tolist(),
        errors.tolist(),
        nbytes.tolist(),
        strict=True,
    ):
        aggs[r].prefixes[c.prefix_names[p]] = PrefixStats(n, int(e), min(int(nb), _INT64_MAX))


def _per_worker(c: _Tasks, aggs: list[RunAggregate]) -> None:
    """Each run's workers (tasks without a worker are no worker's)."""
    none = c.worker_names.index(None) if None in c.worker_names else -1
    mine = np.flatnonzero(c.worker != none)
    if not len(mine):
        return
    order, starts = _segments(c.worker[mine], c.run[mine])
    idx = mine[order]
    counts = np.diff(starts, append=len(idx))
    errors = np.add.reduceat(c.err[idx], starts)
    seconds = np.add.reduceat(c.phases.seconds[idx], starts, axis=0)
    first = np.fmin.reduceat(c.phases.start[idx], starts)
    last = np.fmax.reduceat(c.phases.stop[idx], starts)
    heads = idx[starts]
    for r, w, n, e, s, f, la in zip(
        c.run[heads].tolist(),
        c.worker[heads].tolist(),
        counts.tolist(),
        errors.tolist(),
        seconds.tolist(),
        first.tolist(),
        last.tolist(),
        strict=True,
    ):
        aggs[r].workers[c.worker_names[w]] = WorkerStats(n, int(e), s, _opt(f), _opt(la))


def _per_hour(c: _Tasks, out: BatchAggregate) -> None:
    """The cluster's tasks by the hour of their first start. A task without phases (a
    KilledWorker, a dependent of a failed task, a Ray task cancelled before it ran) counts
    in the hour of its batch's latest time: the runs list counted it, the history did not."""
    start = c.phases.start
    if out.t_max is not None:
        start = np.where(np.isnan(start), out.t_max, start)
    timed = np.flatnonzero(~np.isnan(start))
    if not len(timed):
        return
    hour = np.floor(start[timed] / 3600).astype(np.int64)
    order, starts = _segments(hour)
    idx = timed[order]
    counts = np.diff(starts, append=len(idx))
    errors = np.add.reduceat(c.err[idx], starts)
    seconds = np.add.reduceat(c.phases.seconds[idx], starts, axis=0)
    nbytes = np.add.reduceat(c.nbytes[idx], starts)
    for h, n, e, s, nb in zip(
        hour[order[starts]].tolist(),
        counts.tolist(),
        errors.tolist(),
        seconds.tolist(),
        nbytes.tolist(),
        strict=True,
    ):
        out.hours[h] = HourStats(
            n,
            int(e),
            s[_COMPUTE],
            s[_TRANSFER],
            s[_DISK_READ] + s[_DISK_WRITE],
            min(int(nb), _INT64_MAX),
        )


def _combine(parts: list[tuple[Any, int]]) -> Any:
    """One non-negative int64 code per row for a tuple of codes (``(codes, cardinality)``
    pairs), equal exactly where the tuples are equal and ordered by them, the last part
    least significant. Codes are made dense on the way when the product would overflow."""
    code, card = np.zeros(len(parts[0][0]), dtype=np.int64), 1
    for i, (col, n) in enumerate(parts):
        if card * n >= 2**62:
            code = np.unique(code, return_inverse=True)[1].reshape(-1)
            card = int(code.max()) + 1
        code = code * n + col if i else col.astype(np.int64, copy=False)
        card *= n
    return code


def _phase_groups(
    c: _Tasks, parts: list[tuple[Any, int]], buckets: tuple[Any, Any]
) -> tuple[Any, ...]:
    """Phases grouped by ``parts`` (per-phase codes, see :func:`_combine`) and, within a
    group, by histogram bucket (``buckets``: the distinct buckets and each phase's index
    among them): one sort does both. Per group: the index of a phase in it,
    count, total, min and max; and its histogram ``{bucket: count}``."""
    buckets, bcode = buckets
    nb = len(buckets)
    code = _combine([*parts, (bcode.reshape(-1), nb)])
    order = np.argsort(code, kind="stable")
    s = code[order]
    bstarts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1])))
    g = s[bstarts] // nb
    head = np.concatenate(([True], g[1:] != g[:-1]))
    gstarts = bstarts[head]
    ds = c.d[order]
    counts = np.diff(gstarts, append=len(order))
    # each group's buckets and counts, cut where the group changes
    bl = buckets[bcode.reshape(-1)[order[bstarts]]].tolist()
    nl = np.diff(bstarts, append=len(order)).tolist()
    cuts = [*np.flatnonzero(head).tolist(), len(bl)]
    hists = [
        dict(zip(bl[i:j], nl[i:j], strict=True)) for i, j in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    return (
        order[gstarts],
        counts,
        np.add.reduceat(ds, gstarts),
        np.minimum.reduceat(ds, gstarts),
        np.maximum.reduceat(ds, gstarts),
        hists,
    )


def _per_action(c: _Tasks, aggs: list[RunAggregate], buckets: tuple[Any, Any]) -> None:
    """Per run, prefix and action: count, total, min, max, and the duration histogram."""
    ph_run, ph_prefix = c.run[c.ph_task], c.prefix[c.ph_task]
    heads, counts, totals, mins, maxs, hists = _phase_groups(
        c,
        [
            (ph_run, len(c.run_names)),
            (ph_prefix, len(c.prefix_names)),
            (c.ph_action, len(c.action_names)),
        ],
        buckets,
    )
    for r, p, a, n, tot, lo, hi, h in zip(
        ph_run[heads].tolist(),
        ph_prefix[heads].tolist(),
        c.ph_action[heads].tolist(),
        counts.tolist(),
        totals.tolist(),
        mins.tolist(),
        maxs.tolist(),
        hists,
        strict=True,
    ):
        pa = (c.prefix_names[p], c.action_names[a])
        rs = aggs[r]
        rs.actions[pa] = ActionStats(n, tot, lo, hi)
        rs.hists[pa] = h


def _per_day(c: _Tasks, out: BatchAggregate, buckets: tuple[Any, Any], day: Any, d0: int) -> None:
    """The cluster's durations per prefix, action and day of each phase's start (``day``,
    the first ``d0``), across runs."""
    ph_prefix = c.prefix[c.ph_task]
    heads, counts, totals, _, maxs, hists = _phase_groups(
        c,
        [
            (day - d0, int(day.max()) - d0 + 1),
            (ph_prefix, len(c.prefix_names)),
            (c.ph_action, len(c.action_names)),
        ],
        buckets,
    )
    for p, a, dy, n, tot, hi, h in zip(
        ph_prefix[heads].tolist(),
        c.ph_action[heads].tolist(),
        day[heads].tolist(),
        counts.tolist(),
        totals.tolist(),
        maxs.tolist(),
        hists,
        strict=True,
    ):
        out.days[(c.prefix_names[p], c.action_names[a], dy)] = DayStats(n, tot, hi, h)
