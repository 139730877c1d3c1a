"""Read-side analysis of runs: one run in depth (from its compacted copy, ``runfile``) and
histories across runs and clusters (from the index rollups). Functions take a session or
a :class:`~storage.runs.runfile.RunData`, scope by tenant, and never commit."""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, and_, func, select, true
from sqlalchemy.orm import Session

from storage.analysis.runfacts import DEFAULT_SPAN, fingerprint, makespan
from storage.analysis import sketch
from storage.core import models as m
from storage.core.batches import DEFAULT_RUN
from storage.runs.runfile import RunData, compact_prefix

logger = logging.getLogger(__name__)

QUANTILES = (0.5, 0.9, 0.99)
ACTIONS = ("compute", "transfer", "disk-read", "disk-write")
TASK_SORTS = ("duration", "-duration", "start", "-start")


# ---------------------------------------------------------------- tasks


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


# ---------------------------------------------------------------- per-prefix summary


def _hists(
    db: Session, run_ids: list[int], prefix: str | None = None
) -> dict[tuple[str, str], dict[int, int]]:
    """The runs' histograms per (prefix, action), merged."""
    H = m.RunPrefixHist
    q = select(H.prefix, H.action, H.buckets).where(H.run_id.in_(run_ids))
    if prefix is not None:
        q = q.where(H.prefix == prefix)
    out: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)
    for p, a, buckets in db.execute(q):
        h = out[(p, a)]
        for b, c in (buckets or {}).items():
            h[int(b)] = h.get(int(b), 0) + c
    return out


def prefix_summary(db: Session, run: m.Run) -> list[dict[str, Any]]:
    """Per prefix: count, errors, bytes, and per action count/total/mean/min/p50/p90/p99/max.

    Quantiles come from the run's mergeable histograms (within 4.5%), clamped to the
    exact min and max."""
    hists = _hists(db, [run.id])
    prefixes: dict[str, dict[str, Any]] = {}
    for p in db.execute(
        select(m.RunPrefix).where(m.RunPrefix.run_id == run.id).order_by(m.RunPrefix.prefix)
    ).scalars():
        prefixes[p.prefix] = {
            "prefix": p.prefix,
            "count": p.count,
            "errors": p.errors,
            "nbytes": p.nbytes,
            "actions": {},
        }
    for a in db.execute(
        select(m.RunPrefixAction)
        .where(m.RunPrefixAction.run_id == run.id)
        .order_by(m.RunPrefixAction.prefix, m.RunPrefixAction.action)
    ).scalars():
        entry = prefixes.setdefault(
            a.prefix, {"prefix": a.prefix, "count": 0, "errors": 0, "nbytes": 0, "actions": {}}
        )
        p50, p90, p99 = sketch.quantiles(
            hists.get((a.prefix, a.action), {}), QUANTILES, a.min, a.max
        )
        entry["actions"][a.action] = {
            "count": a.count,
            "total": a.total,
            "mean": a.total / a.count if a.count else None,
            "min": a.min,
            "p50": p50,
            "p90": p90,
            "p99": p99,
            "max": a.max,
        }
    return list(prefixes.values())


# ---------------------------------------------------------------- metrics, progress


def metric_series(
    data: RunData, points: int, worker: str | None = None, name: str | None = None
) -> list[dict[str, Any]]:
    """Per (worker, metric) series, downsampled to at most ``points`` points: the run's
    time range cut into equal bins, each bin's samples averaged (``max`` kept alongside)."""
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
                {"time": t0 + (i + 0.5) * width, "value": sum(vs) / len(vs), "max": max(vs)}
                for i, vs in sorted(bins.items())
            ]
        else:
            pts = [{"time": t, "value": v, "max": v} for t, v in samples]
        out.append({"worker": w, "name": n, "samples": len(samples), "points": pts})
    return out


def progress(data: RunData, buckets: int) -> dict[str, Any]:
    """Completed tasks per prefix per time bucket (by each task's last stop)."""
    stops = [
        (s, p)
        for s, p in zip(
            data.tasks["stop"].to_pylist(), data.tasks["prefix"].to_pylist(), strict=True
        )
        if s is not None
    ]
    if not stops:
        return {"start": None, "bucket_seconds": None, "times": [], "prefixes": {}}
    t0 = min(s for s, _ in stops)
    t1 = max(s for s, _ in stops)
    width = (t1 - t0) / buckets if t1 > t0 else 1.0
    counts: dict[str, list[int]] = defaultdict(lambda: [0] * buckets)
    for s, p in stops:
        counts[p][min(buckets - 1, int((s - t0) / width))] += 1
    return {
        "start": t0,
        "bucket_seconds": width,
        "times": [t0 + (i + 1) * width for i in range(buckets)],
        "prefixes": dict(sorted(counts.items())),
    }


# ---------------------------------------------------------------- graph, errors


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


# Numbers and ids in an exception's text: "bad record 17", "TaskID(98b3...) was
# cancelled", "0x7f3a..." are one error each, not one per task. Possessive, so a long run
# of hex letters costs one pass (it backtracked: 23 s on a 64 KB message).
_VARIES = re.compile(r"0x[0-9a-fA-F]++|\b(?=[a-fA-F]*+[0-9])[0-9a-fA-F]++\b")
# ... except a number that names the error: an exit status, an HTTP or SQL code, a signal,
# a device ("exit status 1" and "exit status 137" are different failures).
_NAMED_BY = re.compile(
    r"(?:status|code|errno|sqlstate|signal|exit|device|http\w*|error)\W{0,3}$", re.IGNORECASE
)


def error_fingerprint(text: str) -> str:
    """The exception text with its numbers and hex ids as ``#``: what groups errors."""

    def mask(m: re.Match[str]) -> str:
        return m.group(0) if _NAMED_BY.search(text, max(0, m.start() - 16), m.start()) else "#"

    return _VARIES.sub(mask, text)


def errors(data: RunData) -> list[dict[str, Any]]:
    """Erred tasks grouped by exception text, its numbers and hex ids set aside (the first
    text is the group's ``exception``; ``messages`` counts the distinct texts), largest
    group first."""
    import pyarrow.compute as pc

    groups: dict[str, dict[str, Any]] = {}
    fingerprints: dict[str, str] = {}  # per distinct text (a failed task's dependents share it)
    table = data.tasks.select(
        ["key", "prefix", "status", "worker", "exception", "traceback", "attrs"]
    )
    # Filter in Arrow first: a 100k-task run has a handful of failures, not 100k Python rows.
    for r in table.filter(pc.equal(table["status"], "erred")).to_pylist():
        exc = r["exception"] or "(no exception recorded)"
        fp = fingerprints.get(exc)
        if fp is None:
            fp = fingerprints[exc] = error_fingerprint(exc)
        g = groups.get(fp)
        if g is None:
            g = groups[fp] = {
                "exception": exc,
                "count": 0,
                "retried": 0,
                "messages": 0,
                "prefixes": {},
                "workers": set(),
                "keys": [],
                "traceback": r["traceback"],
            }
        g["count"] += 1
        if r["attrs"] and json.loads(r["attrs"]).get("retried") is True:
            g["retried"] += 1  # an attempt Dask's retries= ran again
        g["prefixes"][r["prefix"]] = g["prefixes"].get(r["prefix"], 0) + 1
        if r["worker"]:
            g["workers"].add(r["worker"])
        if len(g["keys"]) < 10:
            g["keys"].append(r["key"])
    for fp in fingerprints.values():  # each distinct text once
        groups[fp]["messages"] += 1
    out = sorted(groups.values(), key=lambda g: (-g["count"], g["exception"]))
    for g in out:
        g["workers"] = sorted(g["workers"])
    return out


# ---------------------------------------------------------------- critical path


def _before(records: list[dict[str, Any]], start: float) -> dict[str, Any]:
    """Of a key's records (by stop), the latest that started by ``start``, the dependent's
    compute start (not "ended by": a worker's clock skew can make the record a dependent
    waited for appear to end just after it began); else the first."""
    began = [r for r in records if r["start"] <= start]
    return began[-1] if began else records[0]


def _carve_failed(
    segs: list[dict[str, Any]], failed: list[tuple[float, float, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """A task's segments (latest first) with the time of its failed attempts taken out of
    its waiting: ``failed`` segments on the attempts' workers."""
    out = []
    for seg in segs:
        pieces = [seg]
        if seg["kind"] in ("wait", "unsubmitted"):
            for lo, hi, rec in failed:
                cut = []
                for p in pieces:
                    a, b = max(lo, p["start"]), min(hi, p["stop"])
                    if p["kind"] == "failed" or b <= a:
                        cut.append(p)
                        continue
                    if p["start"] < a:
                        cut.append({**p, "stop": a})
                    cut.append(
                        {**p, "kind": "failed", "worker": rec["worker"], "start": a, "stop": b}
                    )
                    if b < p["stop"]:
                        cut.append({**p, "start": b})
                pieces = cut
        out += sorted(pieces, key=lambda p: -p["start"])
    return out


def critical_path(data: RunData) -> dict[str, Any]:
    """The chain of tasks that set the makespan, walked back from the last task to finish:
    each step goes to the dependency that finished last (the one the task waited for).
    Between a dependency's end and the task's compute, the time is split into the task's
    transfers and disk reads (the phases recorded in that gap) and waiting (queued, or no
    free thread); after its compute, its own phases up to its stop (a disk-write of its
    result). A task the scheduler received after its dependency had finished (a later
    computation of the run: the client waited for something first) did not exist before:
    the time from that end to its submission is ``unsubmitted``, not waiting. The step
    still goes to the dependency: what the client waited for is not recorded (stepping to
    the task that ended last before the submission named unrelated tasks in busy runs).
    Segments are in time order."""
    rows = data.tasks.select(
        [
            "key",
            "prefix",
            "worker",
            "status",
            "start",
            "stop",
            "compute_start",
            "compute_stop",
            "startstops",
        ]
    ).to_pylist()
    # A key computed more than once in a run (recomputed after a worker died, computed
    # again by a second compute() of the run) has a record per time: all of them count for
    # the run's start, and a dependent waited for the latest that started before it did.
    tasks: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in sorted((r for r in rows if r["stop"] is not None), key=lambda r: r["stop"]):
        tasks[r["key"]].append(r)
    graph = data.graph.to_pylist()
    deps = {r["key"]: r["dependencies"] for r in graph}
    # When the scheduler received each task, each time it did (graph events since
    # 2026-11-26; none before).
    submitted = {r["key"]: r.get("submitted") or [] for r in graph}
    if not tasks:
        return {
            "makespan": None,
            "tasks": 0,
            "segments": [],
            "totals": {},
            "clock_skew_seconds": 0.0,
        }
    t0 = min(r["start"] for records in tasks.values() for r in records)
    last = max((records[-1] for records in tasks.values()), key=lambda r: r["stop"])
    segments: list[dict[str, Any]] = []
    seen: set[str] = set()
    node: dict[str, Any] | None = last
    while node is not None and node["key"] not in seen:
        seen.add(node["key"])
        phases = json.loads(node["startstops"])
        cstart = node["compute_start"] if node["compute_start"] is not None else node["start"]
        cstop = node["compute_stop"] if node["compute_stop"] is not None else node["stop"]
        # After compute: the task's own recorded phases (a disk-write of its result) up to
        # its stop, latest first; they were counted as waiting.
        mine = []
        upper = node["stop"]
        for ph in sorted(phases, key=lambda p: -p["stop"]):
            if ph["action"] == "compute" or ph["start"] < cstop:
                continue
            hi = min(ph["stop"], upper)
            if hi <= ph["start"]:
                continue
            mine.append(
                {
                    "kind": ph["action"],
                    "key": node["key"],
                    "prefix": node["prefix"],
                    "worker": node["worker"],
                    "start": ph["start"],
                    "stop": hi,
                    "source": ph.get("source"),
                }
            )
            upper = ph["start"]
        mine.append(
            {
                "kind": "compute",
                "key": node["key"],
                "prefix": node["prefix"],
                "worker": node["worker"],
                "start": cstart,
                "stop": cstop,
            }
        )
        preds = [_before(tasks[d], cstart) for d in deps.get(node["key"], ()) if d in tasks]
        pred = max(preds, key=lambda r: r["stop"]) if preds else None
        ready = pred["stop"] if pred is not None else t0
        # This record's submission: the latest before its compute (a key computed again by
        # a later computation was submitted again).
        sub = max((s for s in submitted.get(node["key"], ()) if s <= cstart), default=None)
        late = sub is not None and ready < sub
        # The gap before compute: its recorded transfers / disk reads, the rest waiting.
        cursor = cstart
        for ph in sorted(phases, key=lambda p: -p["stop"]):
            if ph["action"] == "compute" or ph["stop"] > cstart or ph["stop"] <= ready:
                continue
            lo = max(ph["start"], ready)
            hi = min(ph["stop"], cursor)
            if hi <= lo:
                continue
            if hi < cursor:
                mine.append(
                    {
                        "kind": "wait",
                        "key": node["key"],
                        "prefix": node["prefix"],
                        "worker": node["worker"],
                        "start": hi,
                        "stop": cursor,
                    }
                )
            mine.append(
                {
                    "kind": ph["action"],
                    "key": node["key"],
                    "prefix": node["prefix"],
                    "worker": node["worker"],
                    "start": lo,
                    "stop": hi,
                    "source": ph.get("source"),
                }
            )
            cursor = lo
        if late and cursor > sub:
            mine.append(
                {
                    "kind": "wait",
                    "key": node["key"],
                    "prefix": node["prefix"],
                    "worker": node["worker"],
                    "start": sub,
                    "stop": cursor,
                }
            )
            cursor = sub
        if cursor > ready:
            kind = "unsubmitted" if late else "wait"
            mine.append(
                {
                    "kind": kind,
                    "key": node["key"],
                    "prefix": node["prefix"],
                    "worker": node["worker"],
                    "start": ready,
                    "stop": cursor,
                }
            )
        # Attempts of this task that erred before it ran again (``retries=``,
        # ``client.retry``): their compute was not waiting (found by a review). One may
        # read a few ms past this compute's start (two workers' clocks): clipped there.
        failed = [
            (
                max(r["compute_start"] if r["compute_start"] is not None else r["start"], ready),
                min(r["compute_stop"] if r["compute_stop"] is not None else r["stop"], cstart),
                r,
            )
            for r in tasks[node["key"]]
            if r is not node
            and r["status"] == "erred"
            and ready < r["stop"]
            and r["start"] < cstart
        ]
        if failed:
            mine = _carve_failed(mine, failed)
        segments += mine
        node = pred
    # ``segments`` runs backwards in time. Lay it on one timeline from the last stop back
    # to the run's first start: worker clocks are corrected to the scheduler's by an
    # estimate, so a dependency can appear to end a few ms after its dependent started;
    # such overlaps are clipped (and reported), any gap left is waiting.
    timeline: list[dict[str, Any]] = []
    skew = 0.0
    bound = last["stop"]
    for seg in segments:
        if seg["stop"] > bound:
            skew += seg["stop"] - bound
            seg["stop"] = bound
        if seg["start"] > seg["stop"]:
            seg["start"] = seg["stop"]
        if seg["stop"] < bound:
            timeline.append(
                {
                    "kind": "wait",
                    "key": seg["key"],
                    "prefix": seg["prefix"],
                    "worker": seg["worker"],
                    "start": seg["stop"],
                    "stop": bound,
                }
            )
        timeline.append(seg)
        bound = seg["start"]
    if bound > t0:
        first = timeline[-1]
        timeline.append(
            {
                "kind": "wait",
                "key": first["key"],
                "prefix": first["prefix"],
                "worker": first["worker"],
                "start": t0,
                "stop": bound,
            }
        )
    # Zero-length compute stays: the chain of tasks is the answer, even where skew ate it.
    segments = [s for s in reversed(timeline) if s["stop"] > s["start"] or s["kind"] == "compute"]
    totals: dict[str, float] = defaultdict(float)
    for s in segments:
        s["seconds"] = s["stop"] - s["start"]
        totals[s["kind"]] += s["seconds"]
    return {
        "makespan": last["stop"] - t0,
        "tasks": len(seen),
        "segments": segments,
        "totals": dict(sorted(totals.items())),
        "clock_skew_seconds": skew,
    }


# ---------------------------------------------------------------- time breakdown


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds the union of ``intervals`` covers."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


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
    rows = db.execute(
        select(
            m.RunWorker,
            m.Run.task_start,
            m.Run.task_stop,
            m.Worker.nthreads,
            m.Worker.joined_at,
            m.Worker.left_at,
        )
        .join(m.Run, m.Run.id == m.RunWorker.run_id)
        .outerjoin(
            m.Worker,
            and_(m.Worker.session_id == m.Run.session_id, m.Worker.address == m.RunWorker.worker),
        )
        .where(m.RunWorker.run_id.in_(run_ids))
    ).all()
    per_worker: dict[str, dict[str, float]] = {}
    tot = {"capacity": 0.0, "compute": 0.0, "transfer": 0.0, "spill": 0.0, "other": 0.0}
    # Each worker's spans (per thread count), so runs that overlapped on it count its
    # thread-seconds once: two concurrent runs read a cluster twice its size, half of it
    # idle (found by a trial)
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


# ---------------------------------------------------------------- fingerprints, compare, regressions


def run_fingerprint(db: Session, run: m.Run) -> str:
    prefixes = db.execute(select(m.RunPrefix.prefix).where(m.RunPrefix.run_id == run.id)).scalars()
    return fingerprint(run.name, run.run_key, prefixes)


def _prefix_stats(db: Session, run_ids: list[int], action: str) -> dict[str, dict[str, Any]]:
    hists = _hists(db, run_ids)
    out: dict[str, dict[str, Any]] = {}
    A = m.RunPrefixAction
    for p, count, total, lo, hi in db.execute(
        select(A.prefix, func.sum(A.count), func.sum(A.total), func.min(A.min), func.max(A.max))
        .where(A.run_id.in_(run_ids), A.action == action)
        .group_by(A.prefix)
    ):
        # clamped to the exact min and max, as the run summary's (a one-task prefix's p90 is
        # its duration, not the histogram bucket's value)
        p50, p90, p99 = sketch.quantiles(hists.get((p, action), {}), QUANTILES, lo, hi)
        out[p] = {
            "count": int(count),
            "total": float(total),
            "mean": float(total) / int(count),
            "p50": p50,
            "p90": p90,
            "p99": p99,
        }
    counts = db.execute(
        select(m.RunPrefix.prefix, func.sum(m.RunPrefix.count))
        .where(m.RunPrefix.run_id.in_(run_ids))
        .group_by(m.RunPrefix.prefix)
    ).all()
    for p, c in counts:
        out.setdefault(
            p, {"count": 0, "total": 0.0, "mean": None, "p50": None, "p90": None, "p99": None}
        )
        out[p]["tasks"] = int(c)
    return out


def _delta(a: float | None, b: float | None) -> dict[str, Any]:
    if a is None or b is None:
        return {"a": a, "b": b, "delta": None, "ratio": None}
    return {"a": a, "b": b, "delta": b - a, "ratio": (b / a) if a else None}


def compare(db: Session, a: m.Run, b: m.Run, action: str = "compute") -> dict[str, Any]:
    """Run ``b`` against run ``a``: makespan, per-prefix task counts and duration deltas,
    prefixes new in ``b`` or missing from it."""
    sa, sb = _prefix_stats(db, [a.id], action), _prefix_stats(db, [b.id], action)
    prefixes = []
    for p in sorted(set(sa) & set(sb)):
        x, y = sa[p], sb[p]
        prefixes.append(
            {
                "prefix": p,
                "tasks": _delta(x.get("tasks"), y.get("tasks")),
                "mean": _delta(x["mean"], y["mean"]),
                "p90": _delta(x["p90"], y["p90"]),
                "total": _delta(x["total"], y["total"]),
            }
        )
    return {
        "a": a.public_id,
        "b": b.public_id,
        "action": action,
        "makespan": _delta(
            makespan(a.task_start, a.task_stop), makespan(b.task_start, b.task_stop)
        ),
        "tasks": _delta(a.task_count, b.task_count),
        "errors": _delta(a.error_count, b.error_count),
        "prefixes": prefixes,
        "new_prefixes": sorted(set(sb) - set(sa)),
        "missing_prefixes": sorted(set(sa) - set(sb)),
    }


def previous_runs(
    db: Session, run: m.Run, n: int, scan: int = 1000, *, same_cluster: bool = False
) -> list[m.Run]:
    """The ``n`` latest runs of the tenant with the same fingerprint, started before ``run``
    and ended by its scheduler (a run still running, or closed "lost" when its scheduler
    went silent, holds part of its tasks: as a baseline it made the next run look 80%
    faster); with ``same_cluster``, of ``run``'s cluster only."""
    fp = run_fingerprint(db, run)
    q = select(m.Run).where(
        m.Run.tenant_id == run.tenant_id,
        m.Run.id != run.id,
        m.Run.started_at <= run.started_at,
        m.Run.status.in_(("finished", "erred")),
    )
    if same_cluster:
        q = q.where(m.Run.cluster_id == run.cluster_id)
    if run.name and run.name != DEFAULT_SPAN:  # the default span names no job
        q = q.where(m.Run.name == run.name)  # ix_runs_tenant_name
    candidates = list(db.execute(q.order_by(m.Run.started_at.desc()).limit(scan)).scalars())
    if not candidates:
        return []
    prefixes: dict[int, list[str]] = defaultdict(list)
    for rid, p in db.execute(
        select(m.RunPrefix.run_id, m.RunPrefix.prefix).where(
            m.RunPrefix.run_id.in_([c.id for c in candidates])
        )
    ):
        prefixes[rid].append(p)
    return [c for c in candidates if fingerprint(c.name, c.run_key, prefixes[c.id]) == fp][:n]


def regressions(
    db: Session,
    run: m.Run,
    baseline: int,
    threshold_pct: float,
    action: str = "compute",
    *,
    same_cluster: bool = False,
) -> dict[str, Any]:
    """Prefixes whose p90 in ``run`` moved more than ``threshold_pct`` against the median
    of the p90s of the previous ``baseline`` runs with the same fingerprint (of ``run``'s
    cluster only, with ``same_cluster``). The median, not the p90 of their tasks pooled:
    one slow run among five set the pooled p90, so the normal run after it read 61%
    faster and a slowdown right after it was hidden (found by a trial)."""
    prev = previous_runs(db, run, baseline, same_cluster=same_cluster)
    mine = _prefix_stats(db, [run.id], action)
    base = _median_p90(db, [p.id for p in prev], action) if prev else {}
    flagged, checked = [], []
    for p in sorted(set(mine) & set(base)):
        a, b = base[p], mine[p]["p90"]
        if a is None or b is None or a == 0:
            continue
        change = (b - a) / a * 100.0
        entry = {"prefix": p, "baseline_p90": a, "p90": b, "change_pct": change}
        checked.append(entry)
        if abs(change) > threshold_pct:
            flagged.append(entry | {"direction": "slower" if change > 0 else "faster"})
    return {
        "run": run.public_id,
        "fingerprint": run_fingerprint(db, run),
        "action": action,
        "threshold_pct": threshold_pct,
        "baseline_runs": [p.public_id for p in prev],
        "regressions": sorted(flagged, key=lambda e: -abs(e["change_pct"])),
        "checked": checked,
    }


def _median_p90(db: Session, run_ids: list[int], action: str) -> dict[str, float]:
    """Per prefix, the median over ``run_ids`` of each run's p90 of ``action``."""
    H, A = m.RunPrefixHist, m.RunPrefixAction
    bounds = {
        (r, p): (lo, hi)
        for r, p, lo, hi in db.execute(
            select(A.run_id, A.prefix, A.min, A.max).where(
                A.run_id.in_(run_ids), A.action == action
            )
        )
    }
    p90s: dict[str, list[float]] = defaultdict(list)
    for r, p, buckets in db.execute(
        select(H.run_id, H.prefix, H.buckets).where(H.run_id.in_(run_ids), H.action == action)
    ):
        if (r, p) not in bounds:
            continue
        h = {int(b): c for b, c in (buckets or {}).items()}
        q = sketch.quantiles(h, QUANTILES, *bounds[(r, p)])[1]
        if q is not None:
            p90s[p].append(q)
    return {p: statistics.median(v) for p, v in p90s.items()}


# ---------------------------------------------------------------- histories across clusters

BUCKETS = {"hour": 1, "day": 24}


def _tenant_clusters(db: Session, tenant_id: int, cluster: str | None) -> dict[int, str]:
    q = select(m.Cluster.id, m.Cluster.name).where(m.Cluster.tenant_id == tenant_id)
    if cluster is not None:
        q = q.where(m.Cluster.name == cluster)
    return dict(db.execute(q).all())


def _hour_range(since: float | None, until: float | None) -> tuple[int | None, int | None]:
    lo = math.floor(since / 3600) if since is not None else None
    hi = math.ceil(until / 3600) if until is not None else None
    return lo, hi


def prefix_history(
    db: Session,
    tenant_id: int,
    prefix: str,
    action: str,
    bucket: str,
    since: float | None,
    until: float | None,
    cluster: str | None = None,
) -> list[dict[str, Any]]:
    """A prefix's duration quantiles per time bucket across the tenant's clusters (or one).
    Days come from the ``prefix_days`` rollup (by each task's first start); hours merge
    the histograms of the runs started in each hour."""
    clusters = _tenant_clusters(db, tenant_id, cluster)
    if not clusters:
        return []
    if bucket == "day":
        return _prefix_days(db, list(clusters), prefix, action, since, until)
    sec = BUCKETS[bucket] * 3600
    runs = select(m.Run.id, func.floor(m.Run.started_at / sec).label("slot")).where(
        m.Run.tenant_id == tenant_id, m.Run.cluster_id.in_(list(clusters))
    )
    if since is not None:
        runs = runs.where(m.Run.started_at >= since)
    if until is not None:
        runs = runs.where(m.Run.started_at < until)
    r = runs.subquery()
    H, A = m.RunPrefixHist, m.RunPrefixAction
    hists: dict[int, dict[int, int]] = defaultdict(dict)
    # Merge in the database: expand each run's JSON histogram into (bucket, count) rows and
    # sum per slot, so ~10,000 runs send back a few thousand rows, not 10,000 documents.
    pg = db.get_bind().dialect.name == "postgresql"
    kv = (func.json_each_text if pg else func.json_each)(H.buckets).table_valued("key", "value")
    count = func.sum(kv.c.value.cast(BigInteger) if pg else kv.c.value)
    for s, b, c in db.execute(
        select(r.c.slot, kv.c.key, count)
        .select_from(r.join(H, H.run_id == r.c.id))
        .join(kv, true())
        .where(H.prefix == prefix, H.action == action)
        .group_by(r.c.slot, kv.c.key)
    ):
        hists[int(s)][int(b)] = int(c)
    totals: dict[int, tuple[int, float, float]] = {}
    for s, c, t, hi in db.execute(
        select(r.c.slot, func.sum(A.count), func.sum(A.total), func.max(A.max))
        .join(A, A.run_id == r.c.id)
        .where(A.prefix == prefix, A.action == action)
        .group_by(r.c.slot)
    ):
        totals[int(s)] = (int(c), float(t), float(hi))
    out = []
    for s in sorted(hists):
        n, total, hi = totals.get(s, (sum(hists[s].values()), 0.0, None))
        p50, p90, p99 = sketch.quantiles(hists[s], QUANTILES, hi=hi)
        out.append(
            {
                "time": s * float(sec),
                "count": n,
                "mean": total / n if n else None,
                "p50": p50,
                "p90": p90,
                "p99": p99,
                "max": hi,
            }
        )
    return out


def _prefix_days(
    db: Session,
    cluster_ids: list[int],
    prefix: str,
    action: str,
    since: float | None,
    until: float | None,
) -> list[dict[str, Any]]:
    """Day buckets from the ``prefix_days`` rollup: one row per cluster and day, merged."""
    D = m.PrefixDay
    q = select(D.day, D.count, D.total, D.max, D.buckets).where(
        D.cluster_id.in_(cluster_ids), D.prefix == prefix, D.action == action
    )
    if since is not None:
        q = q.where(D.day >= math.floor(since / 86400))
    if until is not None:
        q = q.where(D.day < math.ceil(until / 86400))
    per: dict[int, list[Any]] = {}
    for day, count, total, hi, buckets in db.execute(q):
        e = per.setdefault(int(day), [{}, 0, 0.0, hi])
        h = e[0]
        for b, c in (buckets or {}).items():
            h[int(b)] = h.get(int(b), 0) + c
        e[1] += count
        e[2] += total
        e[3] = max(e[3], hi)
    out = []
    for day in sorted(per):
        h, n, total, hi = per[day]
        p50, p90, p99 = sketch.quantiles(h, QUANTILES, hi=hi)
        out.append(
            {
                "time": day * 86400.0,
                "count": n,
                "mean": total / n if n else None,
                "p50": p50,
                "p90": p90,
                "p99": p99,
                "max": hi,
            }
        )
    return out


def cluster_history(
    db: Session,
    tenant_id: int,
    bucket: str,
    since: float | None,
    until: float | None,
    cluster: str | None = None,
) -> list[dict[str, Any]]:
    """Per cluster per time bucket: runs started, tasks, errors, compute/transfer/disk seconds."""
    clusters = _tenant_clusters(db, tenant_id, cluster)
    if not clusters:
        return []
    per = BUCKETS[bucket]
    CH = m.ClusterHour
    lo, hi = _hour_range(since, until)
    q = select(
        CH.cluster_id,
        (CH.hour - CH.hour % per).label("slot"),
        func.sum(CH.tasks),
        func.sum(CH.errors),
        func.sum(CH.compute),
        func.sum(CH.transfer),
        func.sum(CH.disk),
        func.sum(CH.nbytes),
    ).where(CH.cluster_id.in_(list(clusters)))
    if lo is not None:
        q = q.where(CH.hour >= lo)
    if hi is not None:
        q = q.where(CH.hour < hi)
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for cid, s, tasks, errs, comp, tr, disk, nb in db.execute(q.group_by(CH.cluster_id, "slot")):
        rows[(cid, int(s))] = {
            "cluster": clusters[cid],
            "time": int(s) * 3600.0,
            "runs": 0,
            "tasks": int(tasks),
            "errors": int(errs),
            "compute_seconds": comp,
            "transfer_seconds": tr,
            "disk_seconds": disk,
            "nbytes": int(nb),
        }
    sec = per * 3600
    rq = select(m.Run.cluster_id, m.Run.started_at).where(
        m.Run.tenant_id == tenant_id, m.Run.cluster_id.in_(list(clusters))
    )
    if since is not None:
        rq = rq.where(m.Run.started_at >= lo * 3600)
    if until is not None:
        rq = rq.where(m.Run.started_at < hi * 3600)
    sub = rq.subquery()
    for cid, s, n in db.execute(
        select(
            sub.c.cluster_id, func.floor(sub.c.started_at / sec).label("s"), func.count()
        ).group_by(sub.c.cluster_id, "s")
    ):
        hour = int(s) * per
        entry = rows.setdefault(
            (cid, hour),
            {
                "cluster": clusters[cid],
                "time": hour * 3600.0,
                "runs": 0,
                "tasks": 0,
                "errors": 0,
                "compute_seconds": 0.0,
                "transfer_seconds": 0.0,
                "disk_seconds": 0.0,
                "nbytes": 0,
            },
        )
        entry["runs"] = int(n)
    return [rows[k] for k in sorted(rows, key=lambda k: (clusters[k[0]], k[1]))]


def cluster_time_breakdown(
    db: Session, tenant_id: int, cluster: str, since: float | None, until: float | None
) -> dict[str, Any] | None:
    """Where the time went on one cluster: the time breakdown of its runs in the window;
    None for a cluster the tenant never recorded."""
    ids = _tenant_clusters(db, tenant_id, cluster)
    if not ids:
        return None
    q = select(m.Run.id).where(m.Run.tenant_id == tenant_id, m.Run.cluster_id.in_(ids))
    if since is not None:
        q = q.where(m.Run.started_at >= since)
    if until is not None:
        q = q.where(m.Run.started_at < until)
    return time_breakdown(db, list(db.execute(q).scalars()))


# ---------------------------------------------------------------- Chrome trace / Perfetto


TRACE_COUNTERS = ("memory.managed", "memory.unmanaged", "memory.spilled", "spill.disk_bytes")


def chrome_trace(data: RunData, run_name: str) -> dict[str, Any]:
    """The run as Chrome trace-event JSON (Perfetto opens it): one process per worker, one
    track (thread) per worker thread for compute (and spill: disk-read/disk-write), and
    a worker's transfers (with their source) on transfer tracks of its own: Dask fetches
    a task's inputs beside whatever its thread computes meanwhile. Slices on one track
    never overlap (Perfetto draws overlapping slices of a track as if nested): one that
    would (concurrent transfers; compute times a few ms off across heartbeats' clock
    corrections) goes on the track's next lane ("thread 3 (2)"). Counter tracks carry each
    worker's managed, unmanaged and spilled memory."""
    rows = data.tasks.select(
        ["key", "prefix", "worker", "thread", "status", "startstops"]
    ).to_pylist()
    starts = [r for r in data.tasks["start"].to_pylist() if r is not None]
    t0 = min(starts) if starts else 0.0
    pids: dict[str, int] = {}
    slices: dict[tuple[str, str], list[tuple[float, float, dict[str, Any]]]] = {}
    for r in rows:
        phases = json.loads(r["startstops"])
        if not phases:  # nothing to draw (an actor's call that never ran): no process for it
            continue
        worker = r["worker"] or "unknown"
        pids.setdefault(worker, len(pids) + 1)
        thread = r["thread"] if r["thread"] is not None else 0
        for ph in phases:
            args = {"key": r["key"], "status": r["status"]}
            if ph.get("source"):
                args["source"] = ph["source"]
            action = ph["action"]
            track = "transfers" if action == "transfer" else f"thread {thread}"
            start, stop = ph["start"] - t0, max(ph["start"], ph["stop"]) - t0
            slices.setdefault((worker, track), []).append(
                (
                    start,
                    stop,
                    {
                        "ph": "X",
                        "name": f"{r['prefix']} {action}" if action != "compute" else r["prefix"],
                        "cat": action,
                        "ts": start * 1e6,
                        "dur": (stop - start) * 1e6,
                        "args": args,
                    },
                )
            )
    events: list[dict[str, Any]] = []
    tid = 0
    for (worker, track), items in sorted(slices.items(), key=lambda kv: (pids[kv[0][0]], kv[0][1])):
        items.sort(key=lambda s: (s[0], s[1]))
        lanes: list[float] = []  # each lane's last stop
        lane_tids: list[int] = []
        for start, stop, event in items:
            lane = next((i for i, end in enumerate(lanes) if end <= start), None)
            if lane is None:
                lane, tid = len(lanes), tid + 1
                lanes.append(stop)
                lane_tids.append(tid)
                name = track if lane == 0 else f"{track} ({lane + 1})"
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pids[worker],
                        "tid": tid,
                        "args": {"name": name},
                    }
                )
            lanes[lane] = stop
            event.update(pid=pids[worker], tid=lane_tids[lane])
            events.append(event)
    # Memory and spill as counter tracks on each worker's process: a spill shows as
    # memory.spilled / spill.disk_bytes rising, whether or not a task's phases recorded it.
    for r in data.metrics.to_pylist():
        if r["name"] not in TRACE_COUNTERS or r["worker"] not in pids:
            continue
        events.append(
            {
                "ph": "C",
                "name": r["name"],
                "pid": pids[r["worker"]],
                "ts": (r["time"] - t0) * 1e6,
                "args": {"bytes": r["value"]},
            }
        )
    for worker, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": worker}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"run": run_name, "start_epoch_s": t0},
    }


# ---------------------------------------------------------------- the run page's facts

#: Buckets of the run page's progress chart.
PAGE_PROGRESS_BUCKETS = 120


def outcome(data: RunData) -> dict[str, int]:
    """How the run's tasks ended: ``keys``, the distinct tasks with a record (``task_count``
    counts every execution: a retry or a recomputation again); ``erred_keys``, those whose
    last record (by stop) erred; ``errored_keys``, those with an erred record, and of them
    ``recovered_keys``, whose last record succeeded (``client.retry``); ``graph``, the
    distinct tasks of the recorded graph, and ``unrecorded``, those of them without a
    record (never ran: cancelled, the client left; or their records were lost)."""
    import numpy as np
    import pyarrow.compute as pc

    t = data.tasks
    out = {
        "keys": 0,
        "erred_keys": 0,
        "errored_keys": 0,
        "recovered_keys": 0,
        "graph": data.graph.num_rows,
        "unrecorded": 0,
    }
    if data.graph.num_rows:
        recorded = pc.is_in(data.graph["key"], value_set=t["key"].combine_chunks())
        out["unrecorded"] = int(pc.sum(pc.invert(recorded)).as_py() or 0)
    n = t.num_rows
    if not n:
        return out
    # a key's records by stop (a record without one first), the last one its end
    order = pc.sort_indices(
        t.select(["key", "stop"]),
        sort_keys=[("key", "ascending"), ("stop", "ascending", "at_start")],
    )
    keys = pc.take(t["key"], order).combine_chunks()
    codes = np.asarray(pc.dictionary_encode(keys).indices)
    first = np.ones(n, dtype=bool)
    first[1:] = codes[1:] != codes[:-1]
    last = np.ones(n, dtype=bool)
    last[:-1] = first[1:]
    status = pc.take(t["status"], order)
    erred = np.asarray(pc.fill_null(pc.equal(status, "erred"), False))
    memory = np.asarray(pc.fill_null(pc.equal(status, "memory"), False))
    any_erred = np.maximum.reduceat(erred, np.flatnonzero(first))
    out["keys"] = int(first.sum())
    out["erred_keys"] = int(erred[last].sum())
    out["errored_keys"] = int(any_erred.sum())
    out["recovered_keys"] = int((any_erred & memory[last]).sum())
    return out


def facts_of(data: RunData) -> dict[str, Any]:
    """The run page's critical path, progress, errors and outcome, computed from the run's
    tables."""
    return {
        "critical": critical_path(data),
        "progress": progress(data, PAGE_PROGRESS_BUCKETS),
        "errors": errors(data),
        "outcome": outcome(data),
    }


def page_facts(db: Session, blobs: Any, run: m.Run, data: RunData) -> dict[str, Any]:
    """What the run page derives from a run's tables: its critical path, progress and
    errors. A finished run's are stored next to its compacted copy (by the finisher below,
    when the run finishes) and read back, so no page view walks a large run's graph."""
    import msgspec
    import zstandard

    key = f"{compact_prefix(db, run)}/{data.tag}/page-v2.json.zst"  # v2: with outcome
    if run.status != "running":
        try:
            return msgspec.json.decode(zstandard.ZstdDecompressor().decompress(blobs.get(key)))
        except FileNotFoundError:
            pass
    facts = facts_of(data)
    if run.status != "running":
        body = zstandard.ZstdCompressor(level=3).compress(msgspec.json.encode(facts))
        blobs.put(key, body, if_absent=True)
    return facts


def finish(fr: Any) -> None:
    """Finisher (``storage.jobs.finish``): the run page's facts, stored when the run finishes."""
    page_facts(fr.db, fr.blobs, fr.run, fr.data())
