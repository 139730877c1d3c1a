"""Replay: what Dask's status page showed of a run at a moment (``GET /v1/runs/{id}/state``).

The scheduler agent samples each open run's task states by prefix (from its span's task
groups) and the cluster's workers on its sampling callback, and once more at the run's
end (``state`` events). Each sample is one ``run_states`` row, inserted once per
(run, time): any order of batches and any retry give the same rows, and ``reindex``
rebuilds them from the batches. Replay at T reads the latest sample at or before T: one
primary-key lookup, however large the run.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.core import models as m

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


def state_at(db: Session, run: m.Run, at: float) -> dict[str, Any]:
    """The run's state at ``at`` (epoch seconds): its latest sample at or before ``at``.

    From the run's end on it is the run's last sample. Before its first sample every task of the run counts as waiting (the run had been
    submitted: samples start within one interval of it) and no worker is shown. A run
    with no samples at all (recorded before replay existed, or not by Dask) answers no
    prefixes and no workers, with ``sampled_at`` None.
    """
    S = m.RunState
    q = select(S.time, S.prefixes, S.workers).where(S.run_id == run.id)
    ended = run.status != "running" and run.finished_at is not None and at >= run.finished_at
    # From the run's end on, its last sample (taken once the scheduler saw it done; a
    # sample taken just before that may be stamped after the last task's stop).
    latest = q if ended else q.where(S.time <= at)
    row = db.execute(latest.order_by(S.time.desc()).limit(1)).first()
    if row is not None:
        return _answer(at, row[0], row[1], row[2])
    first = db.execute(q.order_by(S.time).limit(1)).first()
    if first is None:
        return _answer(at, None, {}, {})
    waiting = {p: [sum(v), 0, 0, 0, 0] for p, v in first[1].items()}
    return _answer(at, None, waiting, {})


def sample_times(db: Session, run_id: int) -> dict[str, Any]:
    """The run's first and last sample times and how many there are (the slider's range)."""
    S = m.RunState
    lo, hi, n = db.execute(
        select(func.min(S.time), func.max(S.time), func.count()).where(S.run_id == run_id)
    ).one()
    return {"first": lo, "last": hi, "samples": n}
