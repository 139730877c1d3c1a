"""A run's tasks, metrics, progress and graph, read from its tables."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from storage.analysis.rundata import RunData
from storage.core.batches import DEFAULT_RUN

TASK_SORTS = ("duration", "-duration", "start", "-start")


@dataclass
class TaskFilters:
    prefix: str | None = None
    worker: str | None = None
    status: str | None = None
    since: float | None = None  # tasks that stopped at or after
    until: float | None = None  # tasks that started before


def filter_tasks(data: RunData, f: TaskFilters, sort: str | None) -> Any:
    """The run's tasks table, filtered and sorted (stored order when ``sort`` is None)."""
    import pyarrow.compute as pc

    t = data.tasks
    mask = None
    for col, want in (("prefix", f.prefix), ("worker", f.worker), ("status", f.status)):
        if want is not None:
            cond = pc.equal(t[col], want)
            mask = cond if mask is None else pc.and_(mask, cond)
    if f.since is not None:
        cond = pc.greater_equal(t["stop"], f.since)
        mask = cond if mask is None else pc.and_(mask, cond)
    if f.until is not None:
        cond = pc.less(t["start"], f.until)
        mask = cond if mask is None else pc.and_(mask, cond)
    if mask is not None:
        t = t.filter(pc.fill_null(mask, False))
    if sort:
        col = "compute" if sort.lstrip("-") == "duration" else "start"
        order = "descending" if sort.startswith("-") else "ascending"
        t = t.take(pc.sort_indices(t, sort_keys=[(col, order)], null_placement="at_end"))
    return t


def task_records(table: Any, run_key: str | None = None) -> list[dict[str, Any]]:
    """Rows of a tasks table as the API's task records (startstops as sent; ``duration``
    is the compute seconds; ``run`` the agent's run id, None for the default run)."""
    run = None if run_key == DEFAULT_RUN else run_key
    out = []
    # "attrs" (the scheduler's own facts, e.g. Ray's attempt) is absent from copies
    # compacted before it existed.
    attrs = ["attrs"] if "attrs" in table.column_names else []
    for row in table.select(
        [
            "key",
            "prefix",
            "group",
            "worker",
            "thread",
            "status",
            "nbytes",
            "typename",
            "startstops",
            "exception",
            "traceback",
            "compute",
            *attrs,
        ]
    ).to_pylist():
        row["startstops"] = json.loads(row["startstops"])
        row["duration"] = row.pop("compute")
        row["run"] = run
        row["attrs"] = json.loads(row["attrs"]) if row.get("attrs") else {}
        out.append(row)
    return out


def metric_series(
    data: RunData, points: int, worker: str | None = None, name: str | None = None
) -> list[dict[str, Any]]:
    """Per (worker, metric) series, downsampled to at most ``points`` points: the run's
    time range cut into equal bins, each bin's samples averaged (``min`` and ``max`` kept
    alongside: the envelope a plot draws, so a spike between two points still shows)."""
    rows = data.metrics.to_pylist()
    series: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if (worker is None or r["worker"] == worker) and (name is None or r["name"] == name):
            series[(r["worker"], r["name"])].append((r["time"], r["value"]))
    out = []
    for (w, n), samples in sorted(series.items()):
        samples.sort()
        if len(samples) > points:
            t0, t1 = samples[0][0], samples[-1][0]
            width = (t1 - t0) / points or 1.0
            bins: dict[int, list[float]] = defaultdict(list)
            for t, v in samples:
                bins[min(points - 1, int((t - t0) / width))].append(v)
            pts = [
                {
                    "time": t0 + (i + 0.5) * width,
                    "value": sum(vs) / len(vs),
                    "min": min(vs),
                    "max": max(vs),
                }
                for i, vs in sorted(bins.items())
            ]
        else:
            pts = [{"time": t, "value": v, "min": v, "max": v} for t, v in samples]
        out.append({"worker": w, "name": n, "samples": len(samples), "points": pts})
    return out


def progress(data: RunData, buckets: int) -> dict[str, Any]:
    """Completed tasks per prefix per time bucket (by each task's last stop). On NumPy
    arrays (a Python pair per task was ~100 MB at 10^6 tasks)."""
    import numpy as np
    import pyarrow.compute as pc

    # two passes over the tasks a row group at a time: the stops' range, then the counts
    t0 = t1 = None
    for t in data.parts("tasks", ["stop"]):
        lo, hi = pc.min_max(t["stop"]).values()
        if lo.is_valid and lo.as_py() == lo.as_py():  # (NaN: no stop)
            t0 = lo.as_py() if t0 is None else min(t0, lo.as_py())
            t1 = hi.as_py() if t1 is None else max(t1, hi.as_py())
    if t0 is None:
        return {"start": None, "bucket_seconds": None, "times": [], "prefixes": {}}
    width = (t1 - t0) / buckets if t1 > t0 else 1.0
    codes: dict[str | None, int] = {}
    counts = np.zeros((0, buckets), dtype=np.int64)
    for t in data.parts("tasks", ["stop", "prefix"]):
        stop = np.asarray(pc.fill_null(t["stop"], float("nan")), dtype=np.float64)
        done = np.flatnonzero(~np.isnan(stop))
        bucket = np.minimum(buckets - 1, ((stop[done] - t0) / width).astype(np.int64))
        enc = pc.dictionary_encode(t["prefix"].combine_chunks().take(done))
        local = [codes.setdefault(p, len(codes)) for p in enc.dictionary.to_pylist()]
        local.append(codes.setdefault(None, len(codes)))  # the last: a task without a prefix
        code = np.asarray(local, dtype=np.int64)[
            np.asarray(pc.fill_null(enc.indices, len(local) - 1), dtype=np.int64)
        ]
        if len(codes) > len(counts):
            counts = np.vstack([counts, np.zeros((len(codes) - len(counts), buckets), "i8")])
        counts += np.bincount(code * buckets + bucket, minlength=len(codes) * buckets).reshape(
            len(codes), buckets
        )
    names = list(codes)
    seen = np.flatnonzero(counts.sum(axis=1))
    return {
        "start": t0,
        "bucket_seconds": width,
        "times": [t0 + (i + 1) * width for i in range(buckets)],
        "prefixes": dict(sorted((names[i], counts[i].tolist()) for i in seen)),
    }


def graph(data: RunData) -> dict[str, Any]:
    """Nodes (every task of the graph, with what its record says) and edges (dep -> key)."""
    attrs = {
        r["key"]: r
        for r in data.tasks.select(
            ["key", "prefix", "status", "worker", "nbytes", "typename", "compute", "start", "stop"]
        ).to_pylist()
    }
    nodes: dict[str, dict[str, Any]] = {}
    edges = []
    for r in data.graph.to_pylist():
        nodes[r["key"]] = {"key": r["key"], "prefix": r["prefix"]}
        edges += [{"source": d, "target": r["key"]} for d in r["dependencies"]]
    for key, a in attrs.items():
        nodes.setdefault(key, {"key": key, "prefix": a["prefix"]})
    out = []
    for key, n in nodes.items():
        a = attrs.get(key)
        if a is not None:
            n.update(
                status=a["status"],
                worker=a["worker"],
                nbytes=a["nbytes"],
                typename=a["typename"],
                duration=a["compute"],
                start=a["start"],
                stop=a["stop"],
            )
        out.append(n)
    return {"nodes": out, "edges": edges}
