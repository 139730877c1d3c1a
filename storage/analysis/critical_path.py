"""The chain of tasks that set a run's makespan."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from storage.analysis.keyhash import hashes
from storage.analysis.rundata import RunData


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
    Segments are in time order.

    Columnar: the walk reads the tasks' keys and times as NumPy arrays (keys as integer
    codes, each key's records a contiguous run of a by-key order, the graph's dependencies
    in CSR form), and only the records on the path become Python rows. Rows of every task
    and graph entry held ~1.2 GB at 10^6 tasks, and the walk touches a chain of them."""
    import numpy as np
    import pyarrow.compute as pc

    empty = {
        "makespan": None,
        "tasks": 0,
        "segments": [],
        "totals": {},
        "clock_skew_seconds": 0.0,
    }
    # Per record, read a row group at a time: its key's hash (a big run's keys are not
    # held as strings: storage.analysis.keyhash), its times and whether it erred.
    cols = ["key", "status", "start", "stop", "compute_start"]
    got: dict[str, list[Any]] = {c: [] for c in cols}
    for t in data.parts("tasks", cols):
        got["key"].append(hashes(t["key"]))
        got["status"].append(
            np.asarray(pc.fill_null(pc.equal(t["status"], "erred"), False), dtype=bool)
        )
        for c in ("start", "stop", "compute_start"):
            got[c].append(_floats(t[c]))
        del t
    hashed, erred_all, start_all, stop_all, cstart_all = (np.concatenate(got.pop(c)) for c in cols)
    # A key computed more than once in a run (recomputed after a worker died, computed
    # again by a second compute() of the run) has a record per time: all of them count for
    # the run's start, and a dependent waited for the latest that started before it did.
    row_of = np.flatnonzero(~np.isnan(stop_all))  # records with a stop, as table rows
    if not len(row_of):
        return empty
    if len(row_of) == len(stop_all):  # (the usual: every record has a stop; no copies)
        stop, start, cstart_of, erred = stop_all, start_all, cstart_all, erred_all
    else:
        stop = stop_all[row_of]
        start = start_all[row_of]
        cstart_of = cstart_all[row_of]
        erred = erred_all[row_of]
        hashed = hashed[row_of]
    del stop_all, start_all, cstart_all, erred_all
    names, code = np.unique(hashed, return_inverse=True)
    del hashed
    # 4 bytes a record where they do (the walk's arrays are most of a big run's finish)
    code = code.reshape(-1).astype(np.int32 if len(names) < 2**31 else np.int64)
    n_keys = len(names)
    # a key's records by stop (ties in table order), as a run of the by-key order
    by_stop = np.argsort(stop, kind="stable")
    by_key = by_stop[np.argsort(code[by_stop], kind="stable")]
    first_of = np.searchsorted(code[by_key], np.arange(n_keys), side="left")
    end_of = np.searchsorted(code[by_key], np.arange(n_keys), side="right")
    # The graph: each key's dependencies (as codes; -1 a key without a record) and
    # submission times, from its last row, as a dict of rows kept the last.
    g = data.columns("graph", ["key", "dependencies", "submitted"])
    g_code = _code_of(hashes(g["key"].combine_chunks()), names)
    g_row = np.full(n_keys, -1, dtype=np.int64)
    rev = np.flatnonzero(g_code >= 0)[::-1]
    kept, at = np.unique(g_code[rev], return_index=True)
    g_row[kept] = rev[at]
    deps = g["dependencies"].combine_chunks()
    dep_off = np.asarray(deps.offsets, dtype=np.int64)
    dep_code = _code_of(hashes(deps.values), names)
    subs = g["submitted"].combine_chunks()
    sub_off = np.asarray(subs.offsets, dtype=np.int64)
    sub_val = _floats(subs.values)
    del g, deps, subs, g_code, rev, kept, at

    def latest_started(k: int, by: float) -> int:
        """Of key ``k``'s records (by stop), the latest that started by ``by``, the
        dependent's compute start (not "ended by": a worker's clock skew can make the
        record a dependent waited for appear to end just after it began); else the first."""
        recs = by_key[first_of[k] : end_of[k]]
        began = np.flatnonzero(start[recs] <= by)
        return int(recs[began[-1]] if len(began) else recs[0])

    def compute_start(i: int) -> float:
        return float(start[i] if np.isnan(cstart_of[i]) else cstart_of[i])

    t0 = float(np.nanmin(start))
    # The last record to stop: of the keys whose last record (by stop) stops last, the one
    # first met in stop order (the first of equal maxima, as ``max`` over the keys would).
    last_rec = by_key[end_of - 1]
    rank = np.empty(len(by_stop), dtype=np.int64)
    rank[by_stop] = np.arange(len(by_stop))
    tied = np.flatnonzero(stop[last_rec] == stop[last_rec].max())
    last = int(last_rec[tied[np.argmin(rank[by_key[first_of[tied]]])]])
    del rank, last_rec, by_stop
    # The walk, on the arrays: each step's record, the record it waited for (None at the
    # chain's start), and its key's submission before its compute.
    chain: list[tuple[int, int | None, float | None]] = []
    seen: set[int] = set()
    step: int | None = last
    while step is not None and int(code[step]) not in seen:
        k = int(code[step])
        seen.add(k)
        cstart = compute_start(step)
        gr = g_row[k]
        pred: int | None = None
        sub: float | None = None
        if gr >= 0:
            for d in dep_code[dep_off[gr] : dep_off[gr + 1]]:
                if d < 0:
                    continue
                r = latest_started(int(d), cstart)
                if pred is None or stop[r] > stop[pred]:
                    pred = r
            s = sub_val[sub_off[gr] : sub_off[gr + 1]]
            s = s[s <= cstart]
            sub = float(s.max()) if len(s) else None
        chain.append((step, pred, sub))
        step = pred
    # Only the records on the path, and their keys' failed attempts, become Python rows.
    wanted = {i for i, p, _ in chain} | {p for _, p, _ in chain if p is not None}
    for i, _, _ in chain:
        k = int(code[i])
        wanted.update(int(r) for r in by_key[first_of[k] : end_of[k]] if erred[r])
    wanted_rows = sorted(wanted)
    picked = data.take(
        "tasks",
        row_of[wanted_rows].tolist(),
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
        ],
    )
    rec = dict(zip(wanted_rows, picked.to_pylist(), strict=True))
    del picked
    segments: list[dict[str, Any]] = []
    for i, p, sub in chain:
        node = rec[i]
        pred_r = rec[p] if p is not None else None
        k = int(code[i])
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
        ready = pred_r["stop"] if pred_r is not None else t0
        # ``sub``: this record's submission, the latest before its compute (a key computed
        # again by a later computation was submitted again).
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
            for j in by_key[first_of[k] : end_of[k]].tolist()
            if j != i and erred[j] and ready < (r := rec[j])["stop"] and r["start"] < cstart
        ]
        if failed:
            mine = _carve_failed(mine, failed)
        segments += mine
    last_r = {"stop": float(stop[last])}
    # ``segments`` runs backwards in time. Lay it on one timeline from the last stop back
    # to the run's first start: worker clocks are corrected to the scheduler's by an
    # estimate, so a dependency can appear to end a few ms after its dependent started;
    # such overlaps are clipped (and reported), any gap left is waiting.
    timeline: list[dict[str, Any]] = []
    skew = 0.0
    bound = last_r["stop"]
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
        "makespan": last_r["stop"] - t0,
        "tasks": len(seen),
        "segments": segments,
        "totals": dict(sorted(totals.items())),
        "clock_skew_seconds": skew,
    }


def _code_of(hashed: Any, names: Any) -> Any:
    """Each hash's position in ``names`` (sorted hashes), -1 where it is not there."""
    import numpy as np

    at = np.minimum(np.searchsorted(names, hashed), max(len(names) - 1, 0))
    found = names[at] == hashed if len(names) else np.zeros(len(hashed), dtype=bool)
    return np.where(found, at, -1).astype(np.int64)


def _floats(column: Any) -> Any:
    """A float column as a NumPy array, null as NaN."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return np.asarray(pc.fill_null(column, float("nan")), dtype=np.float64)
