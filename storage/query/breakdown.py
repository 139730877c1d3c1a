"""Where worker threads' time went over a set of runs."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.core import models as m
from storage.runs import packed


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds the union of ``intervals`` covers."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _run_workers(db: Session, run_ids: list[int]) -> list[tuple[Any, ...]]:
    """(worker's seconds, run's task start and stop, worker's threads, joined and left)
    for every worker of every run."""
    R, W = m.Run, m.Worker
    runs = {
        r: (s, start, stop)
        for r, s, start, stop in db.execute(
            select(R.id, R.session_id, R.task_start, R.task_stop).where(R.id.in_(run_ids))
        )
    }
    used = {r: ws for r, ws in packed.run_workers(db, run_ids).items() if r in runs}
    known: dict[tuple[int, str], tuple[Any, ...]] = {}
    for session_id in sorted({runs[r][0] for r in used}):
        addresses = sorted(
            {w.worker for r, ws in used.items() if runs[r][0] == session_id for w in ws}
        )
        for i in range(0, len(addresses), 5000):
            for address, *info in db.execute(
                select(W.address, W.nthreads, W.joined_at, W.left_at).where(
                    W.session_id == session_id, W.address.in_(addresses[i : i + 5000])
                )
            ):
                known[(session_id, address)] = tuple(info)
    return [
        (w, start, stop, *known.get((session_id, w.worker), (None, None, None)))
        for r, ws in used.items()
        for session_id, start, stop in [runs[r]]
        for w in ws
    ]


def time_breakdown(db: Session, run_ids: list[int]) -> dict[str, Any]:
    """Worker-thread-seconds of the given runs: compute, spill (disk read+write), other
    phases, and idle (thread-seconds the workers offered over the runs' makespans, while
    they were there, that no task used: a worker's threads count once where runs
    overlapped on it); and the seconds of transfers, which Dask does on
    a worker's event loop before the task takes a thread: they do not take from the
    threads' capacity (a worker waiting for its data has idle threads meanwhile). A
    task's disk phases do: Dask reads its spilled inputs while it holds a thread's slot
    (``executing``), as its own metrics count them. Threads come from the worker's
    ``joined`` event."""
    if not run_ids:
        return {
            "runs": 0,
            "capacity": 0.0,
            "compute": 0.0,
            "transfer": 0.0,
            "spill": 0.0,
            "other": 0.0,
            "idle": 0.0,
            "workers": [],
        }
    rows = _run_workers(db, run_ids)
    per_worker: dict[str, dict[str, float]] = {}
    tot = {"capacity": 0.0, "compute": 0.0, "transfer": 0.0, "spill": 0.0, "other": 0.0}
    # Each worker's spans (per thread count), so runs that overlapped on it count its
    # thread-seconds once: otherwise two concurrent runs read a cluster twice its
    # size, half of it idle
    spans: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for w, start, stop, nthreads, joined, left in rows:
        # A worker that joined or left during the run offered its threads only meanwhile
        # (an adaptive cluster's; a Ray worker process, which lives for a few tasks: six
        # 2-second processes were counted for a whole 17.6 s run each).
        if left is not None and joined is not None and left < joined:
            left = None  # left, then joined again: there at the end
        if start is not None and joined is not None:
            start = max(start, min(joined, w.first_start if w.first_start is not None else joined))
        if stop is not None and left is not None:
            stop = min(stop, max(left, w.last_stop if w.last_stop is not None else left))
        if start is not None and stop is not None and stop > start:
            spans.setdefault((w.worker, nthreads or 1), []).append((start, stop))
        d = per_worker.setdefault(
            w.worker, {k: 0.0 for k in tot} | {"tasks": 0, "nthreads": nthreads}
        )
        vals = {
            "compute": w.compute,
            "transfer": w.transfer,
            "spill": w.disk_read + w.disk_write,
            "other": w.other,
        }
        for k, v in vals.items():
            d[k] += v
            tot[k] += v
        d["tasks"] += w.tasks
    for (worker, nthreads), intervals in spans.items():
        cap = _covered(intervals) * nthreads
        per_worker[worker]["capacity"] += cap
        tot["capacity"] += cap
    for d in per_worker.values():
        d["idle"] = max(0.0, d["capacity"] - d["compute"] - d["spill"] - d["other"])
    idle = sum(d["idle"] for d in per_worker.values())
    return {
        "runs": len(run_ids),
        **tot,
        "idle": idle,
        "workers": [{"worker": k, **v} for k, v in sorted(per_worker.items())],
    }
