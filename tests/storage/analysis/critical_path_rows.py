"""The critical path as it was computed before it went columnar: a Python row per task and
graph entry. Kept as the reference the columnar walk (``storage.analysis.critical_path``)
must equal, on synthetic runs with recomputed, failed and late-submitted tasks."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from storage.analysis.rundata import RunData


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


def critical_path_rows(data: RunData) -> dict[str, Any]:
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
    # When the scheduler received each task, each time it did (graph events of older
    # agents carry none).
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
        # ``client.retry``): their compute was not waiting. One may
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
    segments = []
    for s in reversed(timeline):
        if s["stop"] <= s["start"] and s["kind"] != "compute":
            continue
        prev = segments[-1] if segments else None
        if (
            prev is not None
            and s["kind"] != "compute"
            and (prev["kind"], prev["key"], prev["worker"]) == (s["kind"], s["key"], s["worker"])
            and prev["stop"] >= s["start"]
        ):
            # one stretch cut in two (a failed attempt over the task's unsubmitted and
            # waiting time, when a worker's clock read its start before the submission)
            prev["stop"] = max(prev["stop"], s["stop"])
            continue
        segments.append(s)
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
