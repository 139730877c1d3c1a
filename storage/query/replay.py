"""Replay: what Dask's status page showed of a run at a moment (``GET /v1/runs/{id}/state``).

The scheduler agent samples each open run's task states by prefix (from its span's task
groups) and the cluster's workers on its sampling callback, and once more at the run's
end (``state`` events). Each sample is one ``run_states`` row, inserted once per
(run, time): any order of batches and any retry give the same rows, and ``reindex``
rebuilds them from the batches. Replay at T reads the latest sample at or before T: one
primary-key lookup, however large the run.

Where the run's task records are at hand, they say exactly which tasks had finished, were
running or had erred at T: a sample is up to one interval old (a prefix read 5/8 done while
the task stream showed 8/8). Samples fill what records do not hold: the split of finished
tasks into in memory and released, tasks not yet recorded (waiting), and the workers'
memory and occupancy.
"""

from __future__ import annotations

import bisect
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.analysis.rundata import RunData
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.runs import detail

PREFIX_FIELDS = ("waiting", "processing", "memory", "released", "erred")
WORKER_FIELDS = ("managed", "unmanaged", "spilled", "limit")
#: Dask's memory thresholds, as fractions of a worker's limit, from the session's config.
THRESHOLDS = {
    "target": "distributed.worker.memory.target",
    "spill": "distributed.worker.memory.spill",
    "pause": "distributed.worker.memory.pause",
    "terminate": "distributed.worker.memory.terminate",
}


def thresholds(session_info: dict[str, Any] | None) -> dict[str, float | None]:
    """The memory fractions Dask colours by (``target``: blue below it, orange at and above
    it up to the limit), as the session recorded them; None where it did not."""
    config = (session_info or {}).get("config") or {}
    out: dict[str, float | None] = {}
    for name, key in THRESHOLDS.items():
        value = config.get(key)
        out[name] = float(value) if isinstance(value, (int, float)) and value is not False else None
    return out


def _answer(
    at: float, sampled: float | None, prefixes: dict[str, Any], workers: dict[str, Any]
) -> dict[str, Any]:
    return {
        "time": at,
        "sampled_at": sampled,
        "workers": [
            {
                "worker": w,
                "memory": dict(zip(WORKER_FIELDS, v[:4], strict=True)),
                "processing": v[4],
            }
            for w, v in sorted(workers.items())
        ],
        "prefixes": [
            {"prefix": p, **dict(zip(PREFIX_FIELDS, v, strict=True))}
            for p, v in sorted(prefixes.items())
        ],
    }


def state_at(
    db: Session,
    run: m.Run,
    at: float,
    data: RunData | None = None,
    *,
    blobs: BlobStore | None = None,
) -> dict[str, Any]:
    """The run's state at ``at`` (epoch seconds): its latest sample at or before ``at``,
    with each prefix's finished, running and erred tasks from the run's task records when
    ``data`` holds them (:func:`exact_counts`).

    From the run's end on it is the run's last sample. Before its first sample every task
    of the run counts as waiting (the run had been submitted: samples start within one
    interval of it) and no worker is shown. A run with no samples at all (recorded before
    replay existed, or not by Dask) answers no prefixes and no workers, with
    ``sampled_at`` None. A finished run's samples are read from its detail object
    (``storage.runs.detail``) when ``blobs`` is given and it has one.
    """
    ended = run.status != "running" and run.finished_at is not None and at >= run.finished_at
    if blobs is not None and run.detail_digest is not None:
        samples = detail.states(db, blobs, run)
        if not samples:
            return _answer(at, None, {}, {})
        # From the run's end on, its last sample (as below).
        i = len(samples) if ended else bisect.bisect_right([s.time for s in samples], at)
        if i > 0:
            s = samples[i - 1]
            sampled, prefixes, workers = s.time, dict(s.prefixes), dict(s.workers)
        else:
            sampled, workers = None, {}
            prefixes = {p: [sum(v), 0, 0, 0, 0] for p, v in samples[0].prefixes.items()}
    else:
        S = m.RunState
        q = select(S.time, S.prefixes, S.workers).where(S.run_id == run.id)
        # From the run's end on, its last sample (taken once the scheduler saw it done; a
        # sample taken just before that may be stamped after the last task's stop).
        latest = q if ended else q.where(S.time <= at)
        row = db.execute(latest.order_by(S.time.desc()).limit(1)).first()
        if row is not None:
            sampled, prefixes, workers = row[0], row[1], row[2]
        else:
            first = db.execute(q.order_by(S.time).limit(1)).first()
            if first is None:
                return _answer(at, None, {}, {})
            sampled, workers = None, {}
            prefixes = {p: [sum(v), 0, 0, 0, 0] for p, v in first[1].items()}
    if data is not None and data.tasks.num_rows:
        prefixes = with_records(prefixes, exact_counts(data, at))
    return _answer(at, sampled, prefixes, workers)


def exact_counts(data: RunData, at: float) -> dict[str, dict[str, int]]:
    """Per prefix, from the run's task records: ``total`` (distinct tasks recorded),
    ``done`` (the task's latest record started by ``at`` ended without error by then),
    ``erred`` (it ended in error by then) and ``processing`` (it had not ended). A task
    computed more than once (a retry, a recomputation) counts once, by its latest record
    started by ``at``. Linear in the run's records with numpy, after a preparation kept
    with the run's tables."""
    import numpy as np

    rec = data.derived.get("replay")
    if rec is None:
        rec = data.derived["replay"] = _Records.of(data.tasks)
    n = len(rec.prefixes)
    started = rec.start <= at
    ended = rec.stop <= at
    done = np.bincount(rec.prefix[ended & ~rec.erred], minlength=n)
    erred = np.bincount(rec.prefix[ended & rec.erred], minlength=n)
    running = np.bincount(rec.prefix[started & ~ended], minlength=n)
    out = {
        p: {
            "total": int(rec.totals[i]),
            "done": int(done[i]),
            "erred": int(erred[i]),
            "processing": int(running[i]),
        }
        for i, p in enumerate(rec.prefixes)
    }
    for prefix, records in rec.repeated:
        latest = max((r for r in records if r[0] <= at), default=None)
        if latest is not None:
            state = "processing" if not latest[1] <= at else ("erred" if latest[2] else "done")
            out[prefix][state] += 1
    return out


class _Records:
    """A run's task records as arrays: one row per task computed once (its prefix's index,
    start, stop, whether it erred), the tasks computed more than once apart (few: retries,
    recomputations), and each prefix's distinct tasks."""

    def __init__(
        self,
        prefixes: list[str],
        prefix: Any,
        start: Any,
        stop: Any,
        erred: Any,
        repeated: list[tuple[str, list[tuple[float, float, bool]]]],
        totals: Any,
    ) -> None:
        self.prefixes = prefixes
        self.prefix = prefix
        self.start = start
        self.stop = stop
        self.erred = erred
        self.repeated = repeated
        self.totals = totals

    @classmethod
    def of(cls, tasks: Any) -> _Records:
        import numpy as np
        import pyarrow.compute as pc

        t = tasks.select(["key", "prefix", "status", "start", "stop"])
        prefix_codes = pc.dictionary_encode(t["prefix"]).combine_chunks()
        prefixes = [p if p is not None else "" for p in prefix_codes.dictionary.to_pylist()]
        prefix = np.asarray(pc.fill_null(prefix_codes.indices, 0), dtype=np.int64)
        keys = np.asarray(pc.dictionary_encode(t["key"]).combine_chunks().indices, np.int64)
        start = np.asarray(pc.fill_null(t["start"], np.inf), dtype=np.float64)
        stop = np.asarray(pc.fill_null(t["stop"], np.inf), dtype=np.float64)
        erred = np.asarray(pc.fill_null(pc.equal(t["status"], "erred"), False), dtype=bool)
        once = np.bincount(keys)[keys] == 1
        totals = np.bincount(prefix[once], minlength=len(prefixes))
        repeated: dict[int, tuple[str, list[tuple[float, float, bool]]]] = {}
        for row in np.flatnonzero(~once):
            entry = repeated.get(int(keys[row]))
            if entry is None:
                entry = repeated[int(keys[row])] = (prefixes[prefix[row]], [])
                totals[prefix[row]] += 1
            entry[1].append((float(start[row]), float(stop[row]), bool(erred[row])))
        return cls(
            prefixes,
            prefix[once],
            start[once],
            stop[once],
            erred[once],
            list(repeated.values()),
            totals,
        )


def with_records(
    sampled: dict[str, list[int]], exact: dict[str, dict[str, int]]
) -> dict[str, list[int]]:
    """A sample's per-prefix counts (waiting, processing, memory, released, erred) with
    finished, running and erred tasks as the records say: the sample's released count
    (capped at the finished ones) splits them into memory and released, and the rest of
    the tasks the scheduler knew of (the sample's total) count as waiting."""
    out = {}
    for prefix in sorted(set(sampled) | set(exact)):
        s = sampled.get(prefix) or [0, 0, 0, 0, 0]
        e = exact.get(prefix)
        if e is None:
            out[prefix] = list(s)
            continue
        released = min(s[3], e["done"])
        left = max(0, sum(s) - e["done"] - e["erred"])
        # Dask's processing also counts tasks a worker holds before a thread takes them,
        # which have no record yet: the sample's, as far as the unfinished tasks allow.
        processing = max(e["processing"], min(s[1], left))
        waiting = max(0, left - processing)
        out[prefix] = [waiting, processing, e["done"] - released, released, e["erred"]]
    return out


def sample_times(db: Session, run: m.Run, blobs: BlobStore | None = None) -> dict[str, Any]:
    """The run's first and last sample times and how many there are (the slider's range)."""
    if blobs is not None and run.detail_digest is not None:
        samples = detail.states(db, blobs, run)
        if not samples:
            return {"first": None, "last": None, "samples": 0}
        return {"first": samples[0].time, "last": samples[-1].time, "samples": len(samples)}
    S = m.RunState
    lo, hi, n = db.execute(
        select(func.min(S.time), func.max(S.time), func.count()).where(S.run_id == run.id)
    ).one()
    return {"first": lo, "last": hi, "samples": n}


def time_range(run: m.Run, samples: dict[str, Any]) -> tuple[float, float]:
    """The moments a replay of ``run`` can show: from its start (or first sample) to its
    end (or last sample; now while it runs)."""
    lo = min(t for t in (run.started_at, samples["first"]) if t is not None)
    if run.status == "running" or run.finished_at is None:
        return lo, float("inf")
    return lo, max(t for t in (run.finished_at, samples["last"]) if t is not None)
