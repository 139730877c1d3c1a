"""A run as Chrome trace-event JSON (Perfetto opens it)."""

from __future__ import annotations

import json
from typing import Any

from storage.analysis.rundata import RunData

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
